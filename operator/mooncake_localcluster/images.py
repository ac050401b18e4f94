"""Image entrypoints read from the repository's Dockerfiles.

``images/<dir>/Dockerfile`` builds ``ghcr.io/mooncake-operator/<dir>``; the pod runner
starts a container of that image without ``command`` as the Dockerfile's last
``ENTRYPOINT`` + ``args``, so the manifests run here unchanged. The settings table
(``image_entrypoints``) overrides an entry of the same image name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

IMAGE_PREFIX = "ghcr.io/mooncake-operator/"
IMAGES_SUBDIR = "images"
_INSTRUCTION = re.compile(r"^\s*([A-Za-z]+)(?:\s+(.*))?$", re.S)
_ESCAPE_DIRECTIVE = re.compile(r"^#\s*escape\s*=\s*(\S)\s*$", re.I)


def _logical_lines(text: str) -> list[str]:
    """Instructions with line continuations joined and comment lines dropped."""
    escape = "\\"
    lines: list[str] = []
    current = ""
    in_header = True
    for raw in text.splitlines():
        if in_header:
            directive = _ESCAPE_DIRECTIVE.match(raw.strip())
            if directive:
                escape = directive.group(1)
                continue
            if not raw.strip().startswith("#") or "=" not in raw:
                in_header = False
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and current):
            continue  # comments and empty lines may sit inside a continuation
        if stripped.endswith(escape):
            current += stripped[: -len(escape)] + " "
            continue
        current += stripped
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def dockerfile_entrypoint(text: str) -> list[str] | None:
    """The argv of the last ``ENTRYPOINT`` (the final stage's), or None without one.

    Exec form (a JSON array) is taken as is; shell form becomes ``/bin/sh -c '...'`` as
    Docker runs it.
    """
    found: list[str] | None = None
    for line in _logical_lines(text):
        match = _INSTRUCTION.match(line)
        if match is None or match.group(1).upper() != "ENTRYPOINT":
            continue
        value = (match.group(2) or "").strip()
        if value.startswith("["):
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed):
                found = list(parsed)
                continue
        found = ["/bin/sh", "-c", value] if value else []
    return found


def find_images_dir(start: Path | None = None) -> Path | None:
    """``<repo>/images`` above this package (or ``start``), if there is one."""
    here = (start or Path(__file__)).resolve()
    for parent in here.parents:
        candidate = parent / IMAGES_SUBDIR
        if candidate.is_dir() and (parent / "pyproject.toml").is_file():
            return candidate
    return None


def dockerfile_entrypoints(images_dir: Path | None) -> dict[str, list[str]]:
    """``ghcr.io/mooncake-operator/<dir>`` -> ENTRYPOINT of ``images_dir/<dir>/Dockerfile``."""
    table: dict[str, list[str]] = {}
    if images_dir is None or not images_dir.is_dir():
        return table
    for dockerfile in sorted(images_dir.glob("*/Dockerfile")):
        try:
            entrypoint = dockerfile_entrypoint(dockerfile.read_text())
        except (OSError, UnicodeDecodeError):
            continue
        if entrypoint:
            table[IMAGE_PREFIX + dockerfile.parent.name] = entrypoint
    return table


def entrypoint_table(
    images_dir: Path | None, overrides: Mapping[str, list[str]]
) -> dict[str, list[str]]:
    """The Dockerfiles' entries, then the settings table (same image name: settings win)."""
    return {**dockerfile_entrypoints(images_dir), **overrides}
