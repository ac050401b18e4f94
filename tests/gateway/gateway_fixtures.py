"""Gateway subprocesses in front of worker subprocesses, all on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker"))

from worker_fixtures import (
    HOST,
    Master,
    WorkerProc,
    free_port,
    http_json,
    mooncake_master,
    run_worker,
    stop_process,
)

__all__ = ["HOST", "Master", "WorkerProc", "free_port", "http_json", "mooncake_master",
           "run_worker"]

MODEL = "llama3-70b-sim"
START_TIMEOUT_S = 30


def endpoint(w: WorkerProc) -> dict[str, Any]:
    return {"url": w.url, "kv_events": w.kv_endpoint, "kv_replay": w.replay_endpoint}


def model_config(prefill: list[WorkerProc], decode: list[WorkerProc], name: str = MODEL,
                 **extra: Any) -> dict[str, Any]:
    return {"name": name, "prefill": [endpoint(w) for w in prefill],
            "decode": [endpoint(w) for w in decode], **extra}


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
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw


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
            time.sleep(0.05)
        yield g
    finally:
        stop_process(proc)
        for p in (config_path, log_path):
            with contextlib.suppress(OSError):
                os.unlink(p)


def wait_for(cond: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)
