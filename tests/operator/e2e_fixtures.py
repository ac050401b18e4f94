"""The operator end to end on the embedded control plane: a real ``mooncake-operator
operator run --gateway`` process (kopf + the gateway beside it), pods run by the pod runner,
Services through its proxy, a real Mooncake Store."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import yaml
from mooncake_localcluster.kubehttp import ApiError, KubeHttp
from mooncake_testbed.procs import free_port

from .manifests import EXAMPLES

GROUP_PATH = "/apis/mooncake.io/v1alpha1"
#: one line per end-to-end scenario, printed in pytest's summary (tests/operator/conftest.py)
REPORTS: list[str] = []
HOST = "127.0.0.1"


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(ApiError, OSError, ValueError, KeyError):
            last = cond()
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass
class Operator:
    proc: subprocess.Popen[bytes]
    gateway_url: str
    metrics_url: str
    log_path: Path
    env: dict[str, str]
    argv: list[str]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def restart(self) -> None:
        self.stop()
        self.proc = _spawn(self.argv, self.env, self.log_path)
        wait_gateway(self.gateway_url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    log = log_path.open("ab")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_gateway(url: str) -> None:
    wait_for(lambda: http_json(f"{url}/health"), 90, "the gateway")


@contextlib.contextmanager
def run_operator(kubeconfig: Path, tmp: Path) -> Iterator[Operator]:
    gw_port, metrics_port = free_port(), free_port()
    env = dict(os.environ, KUBECONFIG=str(kubeconfig),
               MOONCAKE_OPERATOR_METRICS_PORT=str(metrics_port),
               MOONCAKE_OPERATOR_RESYNC_INTERVAL_S="5",
               MOONCAKE_OPERATOR_BUSY_INTERVAL_S="0.5",
               MOONCAKE_GATEWAY_TIME_SCALE="0.1")
    argv = [sys.executable, "-m", "mooncake_cli", "operator", "run", "--install-crd",
            "--gateway", "--gateway-port", str(gw_port), "--log-level", "INFO"]
    log_path = tmp / "operator.log"
    op = Operator(_spawn(argv, env, log_path), f"http://{HOST}:{gw_port}",
                  f"http://{HOST}:{metrics_port}/metrics", log_path, env, argv)
    try:
        wait_gateway(op.gateway_url)
        yield op
    finally:
        op.stop()


def load_example(name: str, **spec_updates: Any) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    for path, value in spec_updates.items():
        node = obj["spec"]
        *head, last = path.split("__")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return obj


class Clusters:
    """MooncakeCluster CRUD in one namespace."""

    def __init__(self, http: KubeHttp, namespace: str) -> None:
        self.http = http
        self.ns = namespace
        with contextlib.suppress(ApiError):
            http.post("/api/v1/namespaces", {"metadata": {"name": namespace}})

    def path(self, name: str | None = None) -> str:
        base = f"{GROUP_PATH}/namespaces/{self.ns}/mooncakeclusters"
        return f"{base}/{name}" if name else base

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.http.post(self.path(), obj)

    def get(self, name: str) -> dict[str, Any]:
        return self.http.get(self.path(name))

    def patch(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.http.patch(self.path(name), {"spec": spec})

    def delete(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            self.http.delete(self.path(name))

    def condition(self, name: str, ctype: str) -> tuple[str, str]:
        for c in self.get(name).get("status", {}).get("conditions") or []:
            if c["type"] == ctype:
                return c["status"], c["reason"]
        return "Unknown", ""

    def ready(self, name: str) -> bool:
        obj = self.get(name)
        st = obj.get("status") or {}
        return st.get("observedGeneration") == obj["metadata"]["generation"] and \
            self.condition(name, "Ready")[0] == "True"

    def wait_ready(self, name: str, timeout: float = 180) -> dict[str, Any]:
        wait_for(lambda: self.ready(name), timeout, f"{self.ns}/{name} Ready")
        return self.get(name)

    def pods(self, selector: str) -> list[dict[str, Any]]:
        q = urllib.request.quote(selector)
        items: list[dict[str, Any]] = self.http.get(
            f"/api/v1/namespaces/{self.ns}/pods?labelSelector={q}")["items"]
        return items

    def engine_pods(self, name: str, role: str | None = None) -> list[dict[str, Any]]:
        sel = f"mooncake.io/cluster={name}," + (
            f"mooncake.io/role={role}" if role else "mooncake.io/role in (prefill,decode)")
        return [p for p in self.pods(sel) if not p["metadata"].get("deletionTimestamp")]

    def events(self, name: str) -> list[dict[str, Any]]:
        q = urllib.request.quote(f"involvedObject.name={name}")
        items: list[dict[str, Any]] = self.http.get(
            f"/api/v1/namespaces/{self.ns}/events?fieldSelector={q}")["items"]
        return items

    def wait_gone(self, name: str, timeout: float = 90) -> None:
        def gone() -> bool:
            try:
                self.get(name)
            except ApiError as err:
                return err.status == 404
            return False

        wait_for(gone, timeout, f"{self.ns}/{name} deleted")


def gateway_pods(gateway_url: str, model: str) -> set[str]:
    """Pods (``ns/name``) the gateway routes to for ``model``."""
    data = http_json(f"{gateway_url}/conductor/registry?model={model}")
    entries = data.get("models", [data])
    out: set[str] = set()
    for e in entries:
        if e.get("model") == model:
            out |= {i["pod"] for i in e.get("instances", []) if i.get("routable")}
    return out


def assert_openai_serves(url: str, model: str) -> None:
    """Chat and completion requests, streamed and not, through the gateway at ``url`` with
    the ``openai`` client: each gets text back."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5)
    assert chat.choices[0].message.content and chat.usage is not None
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
    assert plain.choices[0].text
    chat_stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
