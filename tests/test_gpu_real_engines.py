"""The real-engine run prepared for a GPU (``benchmarks/gpu_real_engines.py``): its plan,
made on any machine, starts the engines with exactly the operator's arguments and names
every place where one host differs from a cluster."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from mooncake_conformance.envs import EngineEnv
from mooncake_conformance.settings import EngineEnvSettings

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_real_engines",
                                                  ROOT / "benchmarks" / "gpu_real_engines.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["store", "p2p"])
def test_the_plan_runs_the_operators_pods(mode: str, tmp_path: Path) -> None:
    gpu = _script()
    from mooncake_operator import builders
    from mooncake_operator.settings import OperatorSettings

    env = EngineEnv("vllm", "0.33.0", EngineEnvSettings(cache_root=tmp_path / "engines"))
    # the model outside /tmp: the pods mount a /tmp of their own
    plan = gpu.plan(mode, tmp_path, env, Path("/opt/models/tiny-llama"))
    names = [p.name for p in plan.procs]
    store = ["mooncake-master", "store-node"] if mode == "store" else []
    assert names == [*store, "vllm-prefill", "relay-prefill", "vllm-decode", "relay-decode",
                     "vllm-colocated", "gateway"]
    by = {p.name: p for p in plan.procs}
    settings = OperatorSettings()
    rev = builders.revision(plan.ref, plan.spec, settings)
    for n, role in enumerate(("prefill", "decode")):
        pod = builders.engine_pod(plan.ref, plan.spec, settings, role, rev, 0)
        engine = pod["spec"]["containers"][0]
        argv = by[f"vllm-{role}"].argv
        assert argv[:2] == engine["command"] == ["vllm", "serve"]
        # the operator's arguments, but for the port on one host (decode only) and the
        # kubelet's expansion of $(POD_NAME) and the IPC paths staged in the pod's /tmp
        want = list(engine["args"])
        if n:
            want[want.index("--port") + 1] = str(int(want[want.index("--port") + 1]) + 1)
        got = argv[2:]
        assert len(got) == len(want)
        for w, g in zip(want, got, strict=True):
            if "$(POD_NAME)" in w:
                assert g == w.replace("$(POD_NAME)", pod["metadata"]["name"])
            elif "ipc:///tmp/" in w:
                assert g.replace(str(tmp_path / role / "tmp"), "/tmp") == w
            else:
                assert g == w
        assert by[f"vllm-{role}"].notes == ([] if not n else
                                            ["--port 8100 -> 8101 (one host)"])[:1] + (
            ["store master at its loopback address, not the Service's DNS name"]
            if mode == "store" else [])
    ref = by["vllm-colocated"].argv
    assert "--kv-transfer-config" not in ref and "--kv-events-config" not in ref
    assert ref[ref.index("--port") + 1] == "8102"


def test_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_ENGINES_CACHE_ROOT", str(tmp_path))
    assert _script().main(["--dry-run", "--mode", "p2p", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "vllm-prefill: vllm serve" in out and "MooncakeConnector" in out
    assert "differs from the cluster: --port 8100 -> 8101 (one host)" in out


def test_answers_are_read_as_json_or_as_text() -> None:
    """The run reads the gateway's JSON and its Prometheus text (/metrics) alike."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            text = self.path == "/metrics"
            body = b"mooncake_x_total 3\n" if text else b'{"ok": true}'
            self.send_response(500 if self.path == "/fail" else 200)
            self.send_header("Content-Type", "text/plain" if text else "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        gpu = _script()
        assert gpu._http(url + "/state")[::2] == (200, {"ok": True})
        assert gpu._http(url + "/metrics")[::2] == (200, "mooncake_x_total 3\n")
        assert gpu._http(url + "/fail")[::2] == (500, {"ok": True})
    finally:
        server.shutdown()
