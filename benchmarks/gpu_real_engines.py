"""Real engines on one GPU: vLLM prefill and decode started with exactly the arguments the
operator generates, a real Mooncake master (store mode), our worker relays beside them and
our gateway in front. It shows:

1. greedy output through P/D equals a colocated vLLM run of the same model, token for
   token (the colocated engine is the same pod's command line without the KV connector);
2. the gateway's prefix index is fed by the engines' real KV events (its state names the
   blocks stored, applied from the relayed stream);
3. a second request with the same prefix is a measured cache hit (the prefill engine's
   own ``usage.prompt_tokens_details.cached_tokens``, and the gateway's prediction).

What it needs, and why it is not run in CI: an NVIDIA GPU with a few GB free, the vLLM
environment (``mooncake-operator conformance install vllm``) and Mooncake's CUDA wheel in
it (``--install-mooncake`` adds ``mooncake-transfer-engine-cuda13``, the build for vLLM
0.33's CUDA 13), which needs a registry. The model is a tiny Llama with random weights
made here (nothing downloaded).

Where it differs from a cluster (each is printed with the plan): every pod's IP is a
loopback address of its own (127.0.0.2, .3, ...); the prefill and decode engines both
listen on the operator's ``engineHttp`` port on loopback, which one host cannot give
twice, so the decode and reference engines get the next ports (and their relays are told);
the store master is reached at its loopback address instead of the Service's DNS name.

    python benchmarks/gpu_real_engines.py [--mode store|p2p] [--out DIR] [--dry-run]

``--dry-run`` prints the processes it would start (and runs on any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from mooncake_conformance import runner
from mooncake_conformance.envs import EngineEnv
from mooncake_conformance.pods import stage
from mooncake_conformance.settings import EngineEnvSettings
from mooncake_operator import builders
from mooncake_operator.engines import RELEASES
from mooncake_operator.names import ClusterRef
from mooncake_operator.settings import OperatorSettings
from mooncake_operator.spec import MooncakeClusterSpec
from mooncake_testbed.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "clusters" / "vllm.yaml"
MOONCAKE_WHEEL = "mooncake-transfer-engine-cuda13"
#: what the example cluster's engines are given beyond the operator's own flags: a share
#: of one GPU each, and no CUDA-graph capture (minutes saved on a model this small)
EXTRA_ARGS = ["--gpu-memory-utilization=0.2", "--enforce-eager", "--max-num-seqs=8"]
PROMPT = [100 + (i * 37) % 400 for i in range(64)]  # 4 blocks of 16 token ids
SUFFIX = [7 + i for i in range(16)]
MAX_TOKENS = 24
START_TIMEOUT_S = 600.0
POLL_S = 1.0
CLI = [sys.executable, "-m", "mooncake_cli"]


@dataclass
class Proc:
    """One process of the run: its command line, environment and log."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health: str | None = None  # URL that answers 200 once it serves
    notes: list[str] = field(default_factory=list)
    popen: subprocess.Popen[bytes] | None = None


@dataclass
class Plan:
    mode: str
    spec: MooncakeClusterSpec
    ref: ClusterRef
    procs: list[Proc]
    gateway_url: str
    reference_url: str


def _spec(model_dir: Path, mode: str) -> tuple[ClusterRef, MooncakeClusterSpec]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    spec["model"].update({"name": str(model_dir), "servedName": "tiny-llama", "blockSize": 16,
                          "maxModelLen": 4096})
    spec["engine"]["extraArgs"] = EXTRA_ARGS
    for pool in ("prefill", "decode"):
        spec[pool].update({"replicas": 1, "gpusPerReplica": 1, "resources": {}})
    spec["store"].update({"enabled": mode == "store", "protocol": "tcp",
                          "segmentSize": "1Gi", "memoryLimit": "2Gi"})
    ref = ClusterRef("tiny", "gpu-run", "uid-gpu-run", 1)
    return ref, MooncakeClusterSpec.model_validate(spec)


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def plan(mode: str, work: Path, vllm: EngineEnv, model_dir: Path) -> Plan:
    """Every process of the run, staged from the operator's own manifests."""
    settings = OperatorSettings()
    ref, spec = _spec(model_dir, mode)
    rev = builders.revision(ref, spec, settings)
    children = builders.children(ref, spec, settings)
    vllm_bin = str(vllm.path / "bin")
    base_env = {"PATH": f"{vllm_bin}:{os.environ.get('PATH', '')}",
                "HOME": os.environ.get("HOME", str(work)), "HF_HUB_OFFLINE": "1"}
    procs: list[Proc] = []
    ip = iter(f"127.0.0.{n}" for n in range(2, 250))
    master_ip = next(ip)
    if mode == "store":
        master = next(o for o in children if o["kind"] == "Deployment")
        st = stage({"metadata": {"name": "master"}, **master["spec"]["template"]},
                   children, work / "master", container="master", pod_ip=master_ip)
        procs.append(Proc("mooncake-master", [shutil.which("mooncake_master", path=vllm_bin)
                                               or "mooncake_master", *st.args],
                          {**base_env, **st.env}))
        node = next(o for o in children if o["kind"] == "DaemonSet")
        st = stage({"metadata": {"name": "store-node"}, **node["spec"]["template"]}, children,
                   work / "store-node", container="store-node", pod_ip=next(ip))
        st_args = _set_flag(st.args, "--master", f"{master_ip}:{spec.store.master.rpc_port}")
        procs.append(Proc("store-node", [*CLI, *st_args], {**os.environ, **st.env}))
    p = spec.engine.ports
    endpoints: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for n, role in enumerate(builders.POOL_ROLES):
        pod = builders.engine_pod(ref, spec, settings, role, rev, 0)
        pod_ip = next(ip)
        eng = stage(pod, children, work / role, pod_ip=pod_ip)
        rel = stage(pod, children, work / role, container="worker", pod_ip=pod_ip)
        port = p.engine_http + n  # one host: the decode engine takes the next port
        eng_args, rel_args = eng.args, rel.args
        notes = []
        if n:
            eng_args = _set_flag(eng_args, "--port", str(port))
            rel_args = _set_flag(rel_args, "--engine-url", f"http://127.0.0.1:{port}")
            notes.append(f"--port {p.engine_http} -> {port} (one host)")
        env = {**base_env, **eng.env, "CUDA_VISIBLE_DEVICES": "0"}
        if mode == "store":
            _local_master(eng.env["MOONCAKE_CONFIG_PATH"], master_ip,
                          spec.store.master.rpc_port)
            notes.append("store master at its loopback address, not the Service's DNS name")
        procs.append(Proc(f"vllm-{role}", [*eng.command, *eng_args], env,
                          f"http://127.0.0.1:{port}/health", notes))
        procs.append(Proc(f"relay-{role}", [*CLI, *rel_args], {**os.environ, **rel.env},
                          f"http://{pod_ip}:{p.http}/livez"))
        endpoints[role].append({
            "url": f"http://{pod_ip}:{p.http}", "name": pod["metadata"]["name"],
            "pod": f"{ref.namespace}/{pod['metadata']['name']}",
            "kv_events": f"tcp://{pod_ip}:{p.kv_events}",
            "kv_replay": f"tcp://{pod_ip}:{p.kv_replay}"})
    # the colocated reference: the prefill pod's command line without the KV connector
    # (and without KV events, whose socket is the prefill pod's)
    first = next(x for x in procs if x.name == "vllm-prefill")
    ref_port = p.engine_http + 2
    ref_args = _set_flag(first.argv, "--port", str(ref_port))
    for flag in ("--kv-transfer-config", "--kv-events-config"):
        i = ref_args.index(flag)
        ref_args = ref_args[:i] + ref_args[i + 2:]
    procs.append(Proc("vllm-colocated", ref_args,
                      {k: v for k, v in first.env.items() if not k.startswith("MOONCAKE")},
                      f"http://127.0.0.1:{ref_port}/health",
                      ["no --kv-transfer-config, no --kv-events-config"]))
    # the gateway, with the operator's model document and the relays as its endpoints
    doc = builders.gateway_model(ref, spec)
    doc.pop("kubernetes")
    doc.update(endpoints)
    gw_port = free_port()
    cfg = work / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": gw_port, "models": [doc]}))
    procs.append(Proc("gateway", [*CLI, "gateway", "--config", str(cfg)], dict(os.environ),
                      f"http://127.0.0.1:{gw_port}/ready"))
    return Plan(mode, spec, ref, procs, f"http://127.0.0.1:{gw_port}",
                f"http://127.0.0.1:{ref_port}")


def _local_master(path: str, ip: str, port: int) -> None:
    cfg = json.loads(Path(path).read_text())
    cfg["master_server_address"] = f"{ip}:{port}"
    Path(path).write_text(json.dumps(cfg, indent=2))


def _http(url: str, body: Any = None, headers: dict[str, str] | None = None,
          timeout: float = 120.0) -> tuple[int, dict[str, str], Any]:
    """Status, headers and body: parsed when the answer is JSON, else its text (the
    gateway's /metrics; an error page)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, got = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, got = e.read(), e.code, dict(e.headers)
    if got.get("Content-Type", "").startswith("application/json") and raw.strip():
        return status, got, json.loads(raw)
    return status, got, raw.decode(errors="replace")


def _start(proc: Proc, logs: Path) -> None:
    log = (logs / f"{proc.name}.log").open("wb")
    proc.popen = subprocess.Popen(proc.argv, env=proc.env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)


def _wait(proc: Proc, logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while proc.health is not None:
        assert proc.popen is not None
        if proc.popen.poll() is not None:
            tail = (logs / f"{proc.name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{tail}")
        try:
            if _http(proc.health, timeout=5)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: {proc.health} not ready in {START_TIMEOUT_S} s")
        time.sleep(POLL_S)


def _stop(procs: list[Proc]) -> None:
    for proc in reversed(procs):
        if proc.popen is not None and proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGTERM)
    for proc in procs:
        if proc.popen is not None:
            try:
                proc.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)


def _complete(url: str, prompt: list[int], explain: bool = False) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    status, headers, got = _http(url + "/v1/completions", body,
                                 {"x-conductor-explain": "1"} if explain else None)
    if status != 200:
        raise RuntimeError(f"{url}: HTTP {status}: {got}")
    got["_decision"] = json.loads(headers.get("x-conductor-decision", "{}"))
    return dict(got)


def _tokens(answer: dict[str, Any]) -> list[int] | str:
    choice = answer["choices"][0]
    return list(choice.get("token_ids") or []) or str(choice["text"])


def run(p: Plan, out: Path) -> dict[str, Any]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for proc in p.procs:
            print(f"start {proc.name}", flush=True)
            _start(proc, logs)
            _wait(proc, logs)
        reference = _complete(p.reference_url, PROMPT)
        first = _complete(p.gateway_url, PROMPT, explain=True)
        state = _http(p.gateway_url + "/conductor/state?model=tiny-llama")[2]["models"][0]
        second = _complete(p.gateway_url, PROMPT + SUFFIX, explain=True)
        metrics = _http(p.gateway_url + "/metrics")[2]
    finally:
        _stop(p.procs)
    prefill = state["prefill"][0]
    cached = [line for line in str(metrics).splitlines()
              if line.startswith("mooncake_gateway_engine_cached_tokens_total")]
    return {
        "mode": p.mode,
        "pd_equals_colocated": _tokens(first) == _tokens(reference),
        "pd_tokens": _tokens(first), "colocated_tokens": _tokens(reference),
        "index_fed_by_events": {"stored_blocks": prefill["events"]["stored_blocks"],
                                "index_blocks": prefill["index_blocks"],
                                "lost": prefill["events"]["lost"]},
        "second_request": {
            "predicted_held_blocks": second["_decision"].get("held_blocks"),
            "decode_usage": second.get("usage"),
            "gateway_engine_cached_tokens": cached},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["store", "p2p"], default="store",
                    help="MooncakeStoreConnector with a master (default) or MooncakeConnector")
    ap.add_argument("--out", default="gpu-real-engines", help="report and logs folder")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    ap.add_argument("--install-mooncake", action="store_true",
                    help=f"install {MOONCAKE_WHEEL} into the vLLM environment first")
    args = ap.parse_args(argv)
    release = next(r for r in RELEASES if r.kind.value == "vllm")
    env = EngineEnv("vllm", release.version, EngineEnvSettings())
    out = Path(args.out).resolve()
    # not under /tmp: each pod mounts a /tmp of its own, and staging moves paths under it
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_dir = work / "tiny-llama"
    if not args.dry_run:
        if not env.ready():
            ap.error(f"{env.requirement} is not installed: mooncake-operator conformance "
                     "install vllm")
        if args.install_mooncake:
            subprocess.run(["uv", "pip", "install", "--python", str(env.python),
                            MOONCAKE_WHEEL], check=True)
        made = runner.run(env, "model", {"dir": str(model_dir)})
        if not made.get("ok"):
            raise SystemExit(f"could not make the tiny model: {made}")
    p = plan(args.mode, work, env, model_dir)
    for proc in p.procs:
        print(f"{proc.name}: {' '.join(proc.argv)}")
        for note in proc.notes:
            print(f"    differs from the cluster: {note}")
    if args.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    report = run(p, out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    ok = report["pd_equals_colocated"] and report["index_fed_by_events"]["stored_blocks"] > 0
    print(json.dumps(report, indent=2))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
