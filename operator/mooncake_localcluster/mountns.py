"""Give one container process its own view of a few fixed paths, then exec it.

The pod runner starts a container as ``unshare --mount --uts [--user --map-root-user]
python mountns.py --stage DIR [--hostname NAME] [--bind|--ro-bind SRC DST]... --
ARGV...``. In the fresh, private mount namespace this script bind-mounts each SRC (a
per-pod directory or file) onto DST, sets the hostname (the pod's, as a kubelet does)
and then execs ARGV, so ``/var/run/secrets/kubernetes.io/serviceaccount`` and
``/etc/hosts`` show this pod's files while every other process keeps the host's.

A DST whose parent directories do not exist (``/var/run/secrets`` on a host that is no
Kubernetes node) gets them without touching the host: the nearest existing ancestor A is
covered with a tmpfs (built in a directory under ``--stage``, then moved onto A) that
holds a placeholder bind-mounted back to each of A's entries (symlinks are copied), so A
still shows what it held, and the missing directories are made on the tmpfs. (Entries
made in A later, on the host, do not show in the pod; writes into A itself stay in the
pod.) The host's file system is never written to, even as root.

Stdlib only (run as a script with ``python -I -S``): it must start fast, before ARGV.
Failures print ``mooncake-mountns: ...`` and exit ``MOUNT_FAILED_EXIT``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
import sys
from typing import NamedTuple

MOUNT_FAILED_EXIT = 125
NOT_FOUND_EXIT = 127
ERROR_PREFIX = "mooncake-mountns:"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
Bind = tuple[str, str, bool]  # (source, target, read-only)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class MountError(RuntimeError):
    pass


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def enc(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise MountError(f"mount {source or fstype} on {target}: {os.strerror(err)}")


def _placeholder(path: str, like: str) -> None:
    """An empty directory or file at ``path`` to bind ``like`` onto."""
    if os.path.isdir(like):
        os.mkdir(path)
    else:
        with open(path, "wb"):
            pass


def _shadow(ancestor: str, stage: str) -> None:
    """Cover ``ancestor`` with a tmpfs that still shows its entries (see the module doc)."""
    mode = stat.S_IMODE(os.stat(ancestor).st_mode)
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o}")
    with os.scandir(ancestor) as entries:
        for entry in entries:
            src = os.path.join(ancestor, entry.name)
            dst = os.path.join(stage, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(src), dst)
                continue
            _placeholder(dst, src)
            _mount(src, dst, None, MS_BIND | MS_REC)
    _mount(stage, ancestor, None, MS_MOVE)


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def bind(source: str, target: str, stage: str, read_only: bool, covered: list[str]) -> None:
    """Bind-mount ``source`` onto ``target``, making ``target`` (and parents) if needed.

    ``covered`` lists the ancestors already covered by a tmpfs (where making directories
    touches nothing of the host's); it grows when this call covers one.
    """
    target = os.path.realpath(target)
    if not os.path.lexists(target):
        ancestor = _nearest_existing(target)
        if not any(ancestor == c or ancestor.startswith(c + "/") for c in covered):
            if ancestor == "/":
                raise MountError(f"{target}: will not cover / to make its parent directories")
            layer = os.path.join(stage, str(len(covered)))
            os.makedirs(layer, exist_ok=True)
            _shadow(ancestor, layer)
            covered.append(ancestor)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        _placeholder(target, source)
    _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def command(
    binds: list[Bind],
    stage: str,
    argv: list[str],
    python: str = sys.executable,
    as_root: bool | None = None,
    hostname: str | None = None,
) -> list[str]:
    """The argv that runs ``argv`` in its own mount namespace with ``binds`` in place
    (and, given ``hostname``, its own UTS namespace with that hostname).

    Without root (``as_root`` defaults to the effective uid being 0) the namespace needs a
    user namespace too, where the process is root (``--map-root-user``): it can mount there
    but still acts as the invoking user on the host.
    """
    import shutil

    if as_root is None:
        as_root = os.geteuid() == 0
    out = [shutil.which("unshare") or "unshare", "--mount", "--propagation", "private"]
    if hostname:
        out.append("--uts")
    if not as_root:
        out += ["--user", "--map-root-user"]
    out += [python, "-I", "-S", os.path.abspath(__file__), "--stage", stage]
    if hostname:
        out += ["--hostname", hostname]
    for source, target, read_only in binds:
        out += ["--ro-bind" if read_only else "--bind", source, target]
    return [*out, "--", *argv]


class Args(NamedTuple):
    stage: str
    binds: list[Bind]
    command: list[str]
    hostname: str = ""


def parse(argv: list[str]) -> Args:
    """This script's arguments."""
    stage = hostname = ""
    binds: list[Bind] = []
    i = 0
    while i < len(argv) and argv[i] != "--":
        flag = argv[i]
        if flag in ("--stage", "--hostname") and i + 1 < len(argv):
            if flag == "--stage":
                stage = argv[i + 1]
            else:
                hostname = argv[i + 1]
            i += 2
        elif flag in ("--bind", "--ro-bind") and i + 2 < len(argv):
            binds.append((argv[i + 1], argv[i + 2], flag == "--ro-bind"))
            i += 3
        else:
            raise MountError(f"bad argument {flag!r}")
    command = argv[i + 1 :]
    if not stage or not command:
        raise MountError(
            "usage: mountns.py --stage DIR [--hostname NAME] [--bind|--ro-bind SRC DST]..."
            " -- ARGV"
        )
    return Args(stage, binds, command, hostname)


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
        argv = args.command
        # Nothing we mount may leak back to the host (unshare makes it private too).
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        covered: list[str] = []
        for source, target, read_only in args.binds:
            bind(source, target, args.stage, read_only, covered)
        if args.hostname:
            name = os.fsencode(args.hostname)
            if _libc.sethostname(name, ctypes.c_size_t(len(name))) != 0:
                err = ctypes.get_errno()
                raise MountError(f"sethostname {args.hostname!r}: {os.strerror(err)}")
    except (MountError, OSError) as err:
        print(f"{ERROR_PREFIX} {err}", file=sys.stderr, flush=True)
        return MOUNT_FAILED_EXIT
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        print(f"{ERROR_PREFIX} exec {argv[0]!r}: {err}", file=sys.stderr, flush=True)
    return NOT_FOUND_EXIT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
