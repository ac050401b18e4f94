"""Each supported engine version in its own virtual environment, installed once from PyPI.

``mooncake-operator conformance install`` (and ``scripts/test.sh``) make
``<cache_root>/<engine>-<version>/`` with uv: the engine's own wheel and its pinned
dependencies (torch with its CUDA libraries: no GPU is needed to import them). The
first install prints what it is about to fetch, its size and progress; afterwards a stamp
file in the environment (written last, once the engine's installed version was read back
and matched) makes it a cache hit that costs nothing. A half-finished install has no
stamp and is made again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .settings import EngineEnvSettings

Log = Callable[[str], None]
STAMP = ".mooncake-complete"
#: uv's progress lines worth showing (the rest is kept for an error's tail)
_PROGRESS_PREFIXES = ("Resolved", "Prepared", "Installed", "Downloading", "Downloaded",
                      "Using", "Creating")
#: beyond its progress lines, show the next line of uv's once none was shown this long
HEARTBEAT_S = 30.0
#: lines of uv's output kept for a failure's message
TAIL_LINES = 40
#: what one environment weighs, measured when it was added (torch and its CUDA libraries
#: are most of it; a second environment hard-links the files they share from uv's cache)
APPROX_GB = {"vllm": 9, "sglang": 10}


class InstallError(RuntimeError):
    """An engine environment could not be made; the message has uv's last lines."""


@dataclass(frozen=True, slots=True)
class EngineEnv:
    """One engine release's environment: ``vllm`` ``0.33.0`` -> ``<cache>/vllm-0.33.0``."""

    engine: str
    version: str
    settings: EngineEnvSettings

    @property
    def requirement(self) -> str:
        return f"{self.engine}=={self.version}"

    @property
    def path(self) -> Path:
        return self.settings.cache_root / f"{self.engine}-{self.version}"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.path / STAMP

    def ready(self) -> bool:
        return self.stamp.is_file() and self.python.exists()

    def describe(self) -> str:
        state = "installed" if self.ready() else "not installed"
        return f"{self.requirement:<16} {state:<14} {self.path}"

    def install(self, log: Log = print) -> Path:
        """Make the environment unless it is already complete; its python."""
        self.settings.cache_root.mkdir(parents=True, exist_ok=True)
        with _locked(self.path.with_suffix(".lock")):
            if self.ready():
                log(f"[cached] {self.requirement}: {self.path}")
                return self.python
            self._install(log)
        return self.python

    def _install(self, log: Log) -> None:
        size = APPROX_GB.get(self.engine)
        about = f"about {size} GB" if size else "several GB"
        log(f"[install] {self.requirement} is not installed yet: fetching it from PyPI into "
            f"{self.path} ({about}: the engine, torch and its CUDA libraries; no GPU is "
            "needed; under a minute on a fast mirror, 10 minutes or more on a slow link). "
            "Once only: later runs find it cached.")
        started = time.monotonic()
        if self.path.exists():
            shutil.rmtree(self.path)  # a half-finished install (no stamp)
        uv = _uv_command(self.settings)
        env = {**os.environ, "UV_CACHE_DIR": str(self.settings.uv_cache),
               "UV_LINK_MODE": "hardlink", "UV_NO_PROGRESS": "1"}
        _run([*uv, "venv", "--quiet", "--python", self.settings.python, str(self.path)],
             env, log, started, self.settings.install_timeout_s)
        _run([*uv, "pip", "install", "--python", str(self.python), self.requirement],
             env, log, started, self.settings.install_timeout_s)
        got = _installed_version(self.python, self.engine)
        if got != self.version:
            raise InstallError(f"{self.requirement}: the environment holds {self.engine} "
                               f"{got}")
        seconds = time.monotonic() - started
        self.stamp.write_text(json.dumps({"requirement": self.requirement,
                                          "seconds": round(seconds, 1),
                                          "python": sys.version.split()[0]}) + "\n")
        log(f"[done] {self.requirement} in {seconds:.0f}s -> {self.path}")


def _uv_command(settings: EngineEnvSettings) -> list[str]:
    found = shutil.which(settings.uv)
    if found:
        return [found]
    try:
        import uv  # the PyPI package ships its binary beside this module
    except ImportError:
        raise InstallError(f"{settings.uv!r} is not on PATH and the uv package is not "
                           "installed: pip install uv (it is in the dev extra)") from None
    return [uv.find_uv_bin()]


def _run(cmd: list[str], env: dict[str, str], log: Log, started: float,
         timeout_s: float) -> None:
    """Run ``cmd``, showing its progress lines; raise with its tail when it fails."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    assert proc.stdout is not None
    tail: list[str] = []
    last = time.monotonic()
    for raw in proc.stdout:
        line = raw.rstrip()
        tail = [*tail[-TAIL_LINES:], line]
        now = time.monotonic()
        if line.lstrip().startswith(_PROGRESS_PREFIXES) or now - last > HEARTBEAT_S:
            log(f"  [{now - started:5.0f}s] {line.strip()}")
            last = now
        if now - started > timeout_s:
            proc.kill()
            raise InstallError(f"{' '.join(cmd)}: no end after {timeout_s:.0f}s")
    if proc.wait() != 0:
        raise InstallError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(tail))


def _installed_version(python: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise InstallError(f"{python}: cannot read {dist}'s version: {out.stderr.strip()}")
    return out.stdout.strip()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One installer per environment at a time (two pytest sessions, a test and the CLI)."""
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
