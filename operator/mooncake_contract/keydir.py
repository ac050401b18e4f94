"""API keys as the gateway and the operator both read them: a directory laid out the way
Kubernetes mounts a Secret, one file per key. The file's name names the key (in metrics
and logs); its content, stripped, is the key. Hidden entries (the ``..data`` link and the
timestamped folder a Secret volume keeps) and empty files are skipped."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def read_key_dir(path: Path) -> dict[str, str]:
    """``{name: key}`` of a Secret-style directory, by name (``OSError`` if unreadable)."""
    out: dict[str, str] = {}
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        key = entry.read_text(encoding="utf-8").strip()
        if not key:
            log.warning("API key file %s is empty; skipped", entry.name)
            continue
        out[entry.name] = key
    return out
