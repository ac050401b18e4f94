"""Write a projected volume (configMap, secret, downwardAPI) the way the kubelet does.

The kubelet's atomic writer keeps the files in a timestamped directory ``..<time>.<rand>``,
points the symlink ``..data`` at it and makes every top-level name a symlink into
``..data``. An update writes a new timestamped directory and swaps ``..data`` with one
``rename``, so a reader sees either the whole old or the whole new payload; a file's
``st_mtime`` (through the symlink) changes with it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

DATA_LINK = "..data"
DATA_LINK_TMP = "..data_tmp"
TIMESTAMP_FORMAT = "..%Y_%m_%d_%H_%M_%S."
FILE_MODE = 0o644  # the kubelet's defaultMode


def _read_payload(root: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            found[path.relative_to(root).as_posix()] = path.read_bytes()
    return found


def _top_level(paths: Mapping[str, bytes]) -> set[str]:
    return {rel.split("/", 1)[0] for rel in paths}


def _check(rel: str) -> None:
    parts = rel.split("/")
    if rel.startswith("/") or ".." in parts or any(p.startswith("..") for p in parts):
        raise ValueError(f"invalid volume file path {rel!r}")


def write_volume(directory: Path, files: Mapping[str, bytes | str]) -> bool:
    """Make ``directory`` hold exactly ``files`` (relative path -> content), atomically.

    Returns whether anything changed. Entries the writer did not create (e.g. a symlink
    to a nested mount) are left alone.
    """
    payload = {rel: v.encode() if isinstance(v, str) else v for rel, v in files.items()}
    for rel in payload:
        _check(rel)
    directory.mkdir(parents=True, exist_ok=True)
    data_link = directory / DATA_LINK
    old_dir: Path | None = None
    old: dict[str, bytes] = {}
    if data_link.is_symlink():
        old_dir = directory / os.readlink(data_link)
        old = _read_payload(old_dir) if old_dir.is_dir() else {}
    if old_dir is not None and old == payload:
        return False

    stamp = dt.datetime.now(dt.UTC).strftime(TIMESTAMP_FORMAT)
    new_dir = Path(tempfile.mkdtemp(prefix=stamp, dir=directory))
    new_dir.chmod(0o755)
    for rel, content in payload.items():
        target = new_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(FILE_MODE)
    tmp_link = directory / DATA_LINK_TMP
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    tmp_link.symlink_to(new_dir.name)
    tmp_link.replace(data_link)

    for name in _top_level(payload):
        visible = directory / name
        wanted = f"{DATA_LINK}/{name}"
        if visible.is_symlink() and os.readlink(visible) == wanted:
            continue
        if visible.is_symlink() or visible.is_file():
            visible.unlink()
        elif visible.is_dir():
            shutil.rmtree(visible)
        visible.symlink_to(wanted)
    for name in _top_level(old) - _top_level(payload):
        visible = directory / name
        if visible.is_symlink() and os.readlink(visible) == f"{DATA_LINK}/{name}":
            visible.unlink()
    if old_dir is not None and old_dir.is_dir():
        shutil.rmtree(old_dir)
    return True
