"""Subprocess harness: start a worker, a gateway or a Mooncake master and wait until it serves.

Everything binds 127.0.0.1. Logs go to temporary files that are removed on exit; a process
that exits or does not come up in time raises with its log.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mooncake_localcluster.procs import IBVERBS_INSTALL

HOST = "127.0.0.1"
MODEL = "llama3-70b-sim"
START_TIMEOUT_S = 30.0
MASTER_START_TIMEOUT_S = 20.0
STOP_GRACE_S = 10.0
POLL_S = 0.05
MASTER_LEASE_TTL_MS = 200
STORE_INSTALL = "pip install -e '.[store]' (the mooncake-transfer-engine-non-cuda wheel)"

T = TypeVar("T")


class Unavailable(RuntimeError):
    """An external program the harness needs is not installed; the message says how to get it."""


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """Terminate a started server; kill it if it outlives ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: ports handed out come from below Linux's default ephemeral range (32768-60999): a port
#: the kernel picks (``bind(0)``) is free only until some outgoing connection takes it as
#: its local port, which made a worker's bind fail in CI now and then
PORT_RANGE = (20000, 32767)
PORT_TRIES = 200
BIND_RETRIES = 3
ADDRESS_IN_USE = "Address already in use"
_handed_out: set[int] = set()
_port_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that binds now, outside the ephemeral range and never handed
    out before by this process (so two calls never return the same port)."""
    lo, hi = PORT_RANGE
    for _ in range(PORT_TRIES):
        port = _port_rng.randint(lo, hi)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {lo}-{hi} after {PORT_TRIES} tries")


def http_json(url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    """GET (``body`` None) or POST JSON; returns ``(status, parsed body or None)``."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else None


def wait_for(cond: Callable[[], T], timeout: float = 10.0, interval: float = POLL_S) -> T:
    """Poll ``cond`` until it returns something truthy; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


# -- worker -----------------------------------------------------------------------------------

@functools.cache
def worker_command() -> list[str]:
    """The installed console script when the whole CLI imports, else ``python -m``."""
    exe = shutil.which("mooncake-operator")
    if exe is not None:
        rc = subprocess.run([exe, "worker", "--help"], capture_output=True, timeout=60).returncode
        if rc == 0:
            return [exe, "worker"]
    return [sys.executable, "-m", "mooncake_worker"]


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
        return _read(self.log_path)


class _PortTaken(RuntimeError):
    """A started server exited because one of its ports was taken meanwhile."""


def _start_worker(extra: tuple[str, ...], env: dict[str, str] | None, ready_any: bool,
                  ports: tuple[int, int, int]) -> WorkerProc:
    port, kv_port, replay_port = ports
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
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log = w.log()
                kind = _PortTaken if ADDRESS_IN_USE in log else RuntimeError
                raise kind(f"worker exited: {log}")
            try:
                with urllib.request.urlopen(w.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return w
            except urllib.error.HTTPError:
                if ready_any:
                    return w
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {w.log()}")
            time.sleep(POLL_S)
    except BaseException:
        _stop_worker(w)
        raise


def _stop_worker(w: WorkerProc) -> None:
    stop_process(w.proc)
    with contextlib.suppress(OSError):
        os.unlink(w.log_path)


@contextlib.contextmanager
def run_worker(
    *extra: str,
    env: dict[str, str] | None = None,
    ready_any: bool = False,
    ports: tuple[int, int, int] | None = None,
) -> Iterator[WorkerProc]:
    """Start a worker; ready when ``/health`` answers 200 (any answer with ``ready_any``).
    ``ports``: (HTTP, KV events, replay), free ones by default; with free ones, a worker
    that exits because a port was taken meanwhile is started again on new ports."""
    attempt = 0
    while True:
        attempt += 1
        try:
            w = _start_worker(extra, env, ready_any,
                              ports or (free_port(), free_port(), free_port()))
            break
        except _PortTaken:
            if ports is not None or attempt >= BIND_RETRIES:
                raise
    try:
        yield w
    finally:
        _stop_worker(w)


# -- Mooncake master (the real one, from the PyPI wheel) --------------------------------------

@dataclass
class Master:
    proc: subprocess.Popen[bytes]
    rpc: str
    metadata: str


def master_executable() -> str:
    """Path of ``mooncake_master``; :class:`Unavailable` with the install line when absent."""
    exe = shutil.which("mooncake_master")
    if exe is None:
        raise Unavailable(f"mooncake_master is not installed: {STORE_INSTALL}")
    return exe


@contextlib.contextmanager
def run_master() -> Iterator[Master]:
    """A real ``mooncake_master`` with its HTTP metadata server, all on 127.0.0.1."""
    exe = master_executable()
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
        f"--default_kv_lease_ttl={MASTER_LEASE_TTL_MS}",
    ]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + MASTER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                out = log.read().decode(errors="replace")
                if "libibverbs" in out:
                    raise Unavailable(f"mooncake_master needs libibverbs1: {IBVERBS_INSTALL}")
                raise RuntimeError(f"mooncake_master exited: {out}")
            with contextlib.suppress(OSError), socket.create_connection((HOST, rpc_port), 0.2):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake_master did not start")
            time.sleep(POLL_S)
        yield Master(proc, f"{HOST}:{rpc_port}", f"http://{HOST}:{http_port}/metadata")
    finally:
        stop_process(proc)
        log.close()


# -- gateway ----------------------------------------------------------------------------------

def endpoint(w: WorkerProc) -> dict[str, Any]:
    return {"url": w.url, "kv_events": w.kv_endpoint, "kv_replay": w.replay_endpoint}


def model_config(prefill: list[WorkerProc], decode: list[WorkerProc], name: str = MODEL,
                 **extra: Any) -> dict[str, Any]:
    """One ``models[]`` entry of the gateway's config file for these workers."""
    return {"name": name, "prefill": [endpoint(w) for w in prefill],
            "decode": [endpoint(w) for w in decode], **extra}


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw


@dataclass
class GatewayProc:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: str
    config_path: str

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def get(self, path: str) -> Any:
        return http_json(self.url + path)[1]

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None,
             timeout: float = 30) -> tuple[int, dict[str, str], Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, dict(r.headers), _loads(raw)
        except urllib.error.HTTPError as e:
            raw = e.read()
            return e.code, dict(e.headers), _loads(raw)

    def state(self, model: str = MODEL) -> dict[str, Any]:
        models = self.get(f"/conductor/state?model={model}")["models"]
        return dict(models[0])

    def log(self) -> str:
        return _read(self.log_path)


@contextlib.contextmanager
def run_gateway(models: list[dict[str, Any]], wait_ready: bool = True,
                args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                **settings: Any) -> Iterator[GatewayProc]:
    """A gateway subprocess with ``models`` and ``settings`` in its config file; ``args``
    go on its command line, ``env`` into its environment."""
    port = free_port()
    cfg = {"host": HOST, "port": port, "models": models, **settings}
    fd, config_path = tempfile.mkstemp(prefix="gateway-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    fd, log_path = tempfile.mkstemp(prefix="gateway-", suffix=".log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_cli", "gateway", "--config", config_path,
         "--log-level", "INFO", *args], stdout=fd, stderr=fd,
        env={**os.environ, **(env or {})})
    os.close(fd)
    g = GatewayProc(proc, port, log_path, config_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        path = "/ready" if wait_ready else "/health"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {g.log()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(g.url + path, timeout=1) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {g.log()}")
            time.sleep(POLL_S)
        yield g
    finally:
        stop_process(proc)
        for p in (config_path, log_path):
            with contextlib.suppress(OSError):
                os.unlink(p)
