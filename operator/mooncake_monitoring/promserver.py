"""A real Prometheus on loopback, for drills, the demo and the end-to-end tests.

It runs the ``prometheus`` binary (``apt-get install prometheus``; 2.42 on Debian 12) with
a generated configuration, its own TSDB directory and ``--web.listen-address`` on
127.0.0.1 (the binary's default is every interface). Stopping it kills the process.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import promapi

HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0


def find_binary(name: str = "prometheus") -> str:
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found: apt-get install prometheus "
                                "(or put Prometheus 2.x on PATH)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class LocalPrometheus:
    """A Prometheus process serving ``config`` (a ``prometheus.yml`` dict) and ``rules``
    (rules-file dicts, written beside it) from ``workdir``."""

    workdir: Path
    config: dict[str, Any]
    rules: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def write(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = dict(self.config)
        files = []
        for i, rules in enumerate(self.rules):
            path = self.workdir / f"rules-{i}.yaml"
            path.write_text(yaml.safe_dump(rules, sort_keys=False))
            files.append(str(path))
        if files:
            cfg["rule_files"] = files
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def start(self) -> LocalPrometheus:
        binary = find_binary()
        cfg = self.write()
        self.port = self.port or _free_port()
        argv = [binary, f"--config.file={cfg}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={HOST}:{self.port}",
                "--storage.tsdb.retention.time=1d", "--web.enable-lifecycle"]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not promapi.ready(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {self.tail()}")
            time.sleep(0.2)
        return self

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
