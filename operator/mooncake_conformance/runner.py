"""Running a probe inside an engine's environment: one-shot, or live (a publisher)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

from .envs import EngineEnv

PROBES = Path(__file__).parent / "probes"


class ProbeError(RuntimeError):
    """The probe could not run, or answered something that is not its protocol."""


def probe_script(engine: str) -> Path:
    return PROBES / f"{engine}_probe.py"


def _command(env: EngineEnv, command: str) -> list[str]:
    if not env.ready():
        raise ProbeError(f"{env.requirement} is not installed: mooncake-operator conformance "
                         f"install {env.engine}")
    return [str(env.python), "-u", str(probe_script(env.engine)), command]


def _environ() -> dict[str, str]:
    """A clean environment for the engine: no variable of ours leaks into its checks."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "XDG_CACHE_HOME")
    out = {k: os.environ[k] for k in keep if k in os.environ}
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


def run(env: EngineEnv, command: str, request: dict[str, Any]) -> dict[str, Any]:
    """One probe command; its result (``ok`` False with ``stage`` and ``error`` when the
    engine refused something)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run(_command(env, command), input=json.dumps(request) + "\n",
                              stdout=subprocess.PIPE, stderr=log, text=True,
                              timeout=env.settings.probe_timeout_s, env=_environ(),
                              check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        if not lines:
            log.seek(0)
            raise ProbeError(f"{env.requirement} probe {command!r} exited {proc.returncode} "
                             f"without an answer:\n{_tail(log.read())}")
        result: dict[str, Any] = json.loads(lines[-1])
        if not result.get("ok"):
            log.seek(0)
            result["log"] = _tail(log.read())
        return result


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


class LiveProbe:
    """A probe that keeps running (a publisher): read its event lines, send it commands."""

    def __init__(self, env: EngineEnv, command: str, request: dict[str, Any]) -> None:
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(_command(env, command), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, env=_environ())
        self.timeout_s = env.settings.probe_timeout_s
        self.name = f"{env.requirement} probe {command!r}"
        self.send(json.dumps(request))

    @property
    def _out(self) -> IO[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        """The probe's next line (blocking; the probe answers within its own timeouts)."""
        line = self._out.readline()
        if not line:
            self.proc.wait(timeout=self.timeout_s)
            self._log.seek(0)
            raise ProbeError(f"{self.name} ended ({self.proc.returncode}):\n"
                             f"{_tail(self._log.read())}")
        msg: dict[str, Any] = json.loads(line)
        if msg.get("ok") is False:
            self._log.seek(0)
            raise ProbeError(f"{self.name} failed at {msg.get('stage')}: {msg.get('error')}\n"
                             f"{_tail(self._log.read())}")
        return msg

    def finish(self) -> dict[str, Any]:
        """Stop it; its result."""
        self.send("stop")
        result = self.read()
        self.proc.wait(timeout=self.timeout_s)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
