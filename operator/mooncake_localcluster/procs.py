"""Local process bookkeeping: free loopback ports, pid files, process-group stops."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PID_SUFFIX = ".pid.json"
CLAIM_PREFIX = "mooncake-localcluster:"


def free_port(host: str) -> int:
    """A currently free TCP port on ``host`` (loopback only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


LDCONFIG_CANDIDATES = ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
#: the Mooncake transfer engine (PyPI wheel) links it, even over TCP: every store process
#: of the embedded cluster (master, store nodes, engines with a store) fails without it
IBVERBS_SONAME = "libibverbs.so.1"
IBVERBS_INSTALL = "apt-get install libibverbs1"


def listed_by_ldconfig(listing: str, soname: str) -> bool:
    """Whether ``ldconfig -p`` output ``listing`` names the library ``soname`` exactly (its
    lines read ``<tab>libfoo.so.1 (libc6,x86-64) => /path``)."""
    return any(line.split(maxsplit=1)[:1] == [soname] for line in listing.splitlines())


def shared_library_installed(soname: str) -> bool:
    """Whether the dynamic linker finds ``soname``: listed in its cache (``ldconfig -p``).
    False where no ``ldconfig`` runs."""
    for candidate in LDCONFIG_CANDIDATES:
        try:
            out = subprocess.run([candidate, "-p"], capture_output=True, text=True,
                                 check=False)
        except OSError:
            continue
        return listed_by_ldconfig(out.stdout, soname)
    return False


LISTEN_CHECK_TIMEOUT_S = 0.5


def listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (loopback only)."""
    try:
        with socket.create_connection((host, port), timeout=LISTEN_CHECK_TIMEOUT_S):
            return True
    except OSError:
        return False


def claim(name: str) -> socket.socket | None:
    """Hold ``name`` host-wide, or None when another process holds it.

    An abstract unix socket: one namespace per network namespace, shared by all users,
    released by the kernel when the last process holding the socket exits.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + CLAIM_PREFIX + name)
    except OSError:
        sock.close()
        return None
    return sock


@dataclass(frozen=True)
class PidRecord:
    """A process we started in its own process group, with enough to recognise it later."""

    name: str
    pid: int
    marker: str  # what it runs (for people reading the pid file)
    start_time: int = 0  # /proc/<pid>/stat starttime: survives exec, guards against pid reuse

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}{PID_SUFFIX}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: Path) -> PidRecord | None:
        try:
            data = json.loads(path.read_text())
            return cls(
                name=str(data["name"]),
                pid=int(data["pid"]),
                marker=str(data["marker"]),
                start_time=int(data.get("start_time", 0)),
            )
        except (OSError, ValueError, KeyError):
            return None


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (index 0 is field 3, the state)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


STARTTIME_INDEX = 19  # field 22 of /proc/<pid>/stat


def start_time(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[STARTTIME_INDEX]) if fields else 0


def is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is None or fields[0] == "Z"


def alive(record: PidRecord) -> bool:
    """The recorded process itself still runs (not a zombie, not a reused pid)."""
    if is_zombie(record.pid):
        return False
    if record.start_time:
        return start_time(record.pid) == record.start_time
    return record.marker in cmdline(record.pid)


def records(directory: Path) -> list[PidRecord]:
    if not directory.is_dir():
        return []
    found = (PidRecord.read(p) for p in sorted(directory.glob(f"*{PID_SUFFIX}")))
    return [r for r in found if r is not None]


def start(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    pid_dir: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    marker: str | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session (own process group), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
            pass_fds=tuple(pass_fds),
        )
    record = PidRecord(
        name=name, pid=proc.pid, marker=marker or argv[0], start_time=start_time(proc.pid)
    )
    record.write(pid_dir)
    return proc


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A group whose only members are zombies counts as gone.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid and not is_zombie(int(entry.name)):
                return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def stop_group(pgid: int, timeout_s: float, poll_s: float = 0.1) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pgid)
        if not group_alive(pgid):
            return
        time.sleep(poll_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and group_alive(pgid):
        _reap(pgid)
        time.sleep(poll_s)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop_record(record: PidRecord, pid_dir: Path, timeout_s: float) -> bool:
    """Stop a recorded process group if it is still ours; remove its pid file."""
    stopped = False
    leader_gone = _stat_fields(record.pid) is None or is_zombie(record.pid)
    # Members of its group may outlive the leader (e.g. a shell's children): stop them too.
    # A pid still used as a process group id is never reused, so the group is still ours.
    if alive(record) or (leader_gone and group_alive(record.pid)):
        stop_group(record.pid, timeout_s)
        stopped = True
    with contextlib.suppress(FileNotFoundError):
        (pid_dir / f"{record.name}{PID_SUFFIX}").unlink()
    return stopped


def rss_kib(pid: int) -> int:
    """Resident set size of one process in KiB (0 if gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return 0
    return 0


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids
