"""Fixtures: worker subprocesses on free 127.0.0.1 ports, a real mooncake_master."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

HOST = "127.0.0.1"


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Terminate a server started by a fixture; kill it if it outlives ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@functools.cache
def worker_command() -> list[str]:
    """The installed console script when the whole CLI imports, else ``python -m``."""
    exe = shutil.which("mooncake-operator")
    if exe is not None:
        rc = subprocess.run([exe, "worker", "--help"], capture_output=True, timeout=60).returncode
        if rc == 0:
            return [exe, "worker"]
    return [sys.executable, "-m", "mooncake_worker"]


def http_json(url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else None


@dataclass
class WorkerProc:
    proc: subprocess.Popen[bytes]
    port: int
    kv_port: int
    replay_port: int
    args: list[str] = field(default_factory=list)
    log_path: str = ""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://{HOST}:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{HOST}:{self.replay_port}"

    def get(self, path: str) -> Any:
        return http_json(self.url + path)[1]

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        return http_json(self.url + path, body)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def run_worker(
    *extra: str,
    env: dict[str, str] | None = None,
    ready_any: bool = False,
    ports: tuple[int, int, int] | None = None,
) -> Iterator[WorkerProc]:
    """Start a worker; ready when ``/health`` answers 200 (any answer with ``ready_any``).
    ``ports``: (HTTP, KV events, replay), free ones by default."""
    port, kv_port, replay_port = ports or (free_port(), free_port(), free_port())
    args = [
        *worker_command(),
        "--host", HOST, "--port", str(port),
        "--kv-events-port", str(kv_port), "--kv-replay-port", str(replay_port),
        *extra,
    ]
    fd, log_path = tempfile.mkstemp(prefix="worker-", suffix=".log")
    proc = subprocess.Popen(args, stdout=fd, stderr=fd, env={**os.environ, **(env or {})})
    os.close(fd)
    w = WorkerProc(proc, port, kv_port, replay_port, args, log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited: {w.log()}")
            try:
                with urllib.request.urlopen(w.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError:
                if ready_any:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {w.log()}")
            time.sleep(0.05)
        yield w
    finally:
        stop_process(proc)
        with contextlib.suppress(OSError):
            os.unlink(log_path)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    """A fast (time-scale 0) worker shared by a test module."""
    with run_worker("--time-scale", "0", "--max-model-len", "4096") as w:
        yield w


# -- Mooncake Store ---------------------------------------------------------------------------

@dataclass
class Master:
    proc: subprocess.Popen[bytes]
    rpc: str
    metadata: str


def _store_unavailable(reason: str) -> None:
    """Skip on a developer machine without the store; fail where it was promised
    (``scripts/test.sh`` and CI set MOONCAKE_REQUIRE_STORE=1 after installing it)."""
    if os.environ.get("MOONCAKE_REQUIRE_STORE") == "1":
        pytest.fail(f"Mooncake Store required but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[Master]:
    exe = shutil.which("mooncake_master")
    if exe is None:
        _store_unavailable("mooncake_master not installed "
                           "(pip install mooncake-transfer-engine-non-cuda)")
    rpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    args = [
        exe,
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={HOST}",
        f"--http_metadata_server_port={http_port}",
        f"--rpc_address={HOST}",
        f"--rpc_port={rpc_port}",
        f"--metrics_host={HOST}",
        f"--metrics_port={metrics_port}",
        "--default_kv_lease_ttl=200",
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                log.seek(0)
                out = log.read().decode(errors="replace")
                if "libibverbs" in out:
                    _store_unavailable("mooncake_master needs libibverbs1 "
                                       "(apt-get install libibverbs1)")
                raise RuntimeError(f"mooncake_master exited: {out}")
            with contextlib.suppress(OSError), socket.create_connection((HOST, rpc_port), 0.2):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake_master did not start")
            time.sleep(0.05)
        yield Master(proc, f"{HOST}:{rpc_port}", f"http://{HOST}:{http_port}/metadata")
    finally:
        stop_process(proc)
        log.close()
