"""End-to-end replay: real Mooncake Store + N prefill + N decode simulated workers + gateway,
the bundled conversation trace replayed by ``mooncake-operator replay`` once per policy.

    python benchmarks/gateway_e2e.py [--policies random,round-robin,conductor]
        [--requests 300] [--time-scale 0.1] [--speed 0.5] [--instances 4]
        [--prefill-noise SIGMA] [--repeats N] [--json OUT]

``--speed`` is the modelled load (× the trace's real rate); the replay runs at
``speed / time_scale`` on the wall clock while the workers run at ``time_scale``.
A policy written ``NAME@D`` runs with the gateway's ``prefill_dispatch_depth`` D (e.g.
``conductor@0,conductor``: late binding off, then on). ``--prefill-noise`` gives every
prefill worker that log-normal error against the cost model the gateway predicts with;
``--repeats`` runs the policy list that many times, interleaved, and reports each run
and the means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from mooncake_testbed.procs import (
    Unavailable,
    WorkerProc,
    model_config,
    run_gateway,
    run_master,
    run_worker,
)

#: the warm-up pass (fills the store with every prompt block) runs this fast (modelled ×)
WARMUP_SPEED = 4.0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hits(ws: list[WorkerProc]) -> tuple[float, float]:
    return (sum(w.metric("vllm:prefix_cache_hits_total") for w in ws),
            sum(w.metric("vllm:prefix_cache_queries_total") for w in ws))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="random,round-robin,conductor")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--speed", type=float, default=0.5)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--prefill-running", type=int, default=1,
                    help="prompts a prefill worker runs at once (1: FIFO, as the paper)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the first pass that fills the store (its puts cost CPU)")
    ap.add_argument("--no-store", action="store_true")
    ap.add_argument("--prefill-noise", type=float, default=0.0,
                    help="sigma of the prefill workers' log-normal error against the model")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        store: tuple[str, ...] = ()
        if not a.no_store:
            m = stack.enter_context(run_master())
            store = ("--store", m.rpc, "--store-metadata", m.metadata)
        common = ("--time-scale", str(a.time_scale), "--max-model-len", "131072", *store)
        prefill = [stack.enter_context(run_worker(*common, "--role", "prefill",
                                                  "--max-running", str(a.prefill_running),
                                                  "--prefill-noise", str(a.prefill_noise),
                                                  "--noise-seed", str(i)))
                   for i in range(a.instances)]
        decode = [stack.enter_context(run_worker(*common, "--role", "decode"))
                  for _ in range(a.instances)]
        policies = a.policies.split(",") * a.repeats
        if a.warmup and not a.no_store:
            policies = ["warmup", *policies]
        for run_no, spec in enumerate(policies):
            for w in prefill + decode:
                w.post("/reset_prefix_cache", {})
            warm = spec == "warmup"
            policy, _, depth = spec.partition("@")
            extra = {"prefill_dispatch_depth": int(depth)} if depth else {}
            model = model_config(prefill, decode, max_model_len=131072,
                                 conductor={"policy": "round-robin" if warm else policy})
            with run_gateway([model], time_scale=a.time_scale, health_timeout_s=5,
                             connect_timeout_s=10, **extra) as g:
                h0, q0 = hits(prefill)
                c0 = {k: sum(cpu_s(w.proc.pid) for w in ws)
                      for k, ws in (("prefill", prefill), ("decode", decode))}
                c0["gateway"] = cpu_s(g.proc.pid)
                fd, out = tempfile.mkstemp(suffix=".json")
                os.close(fd)
                t0 = time.time()
                proc = subprocess.run(
                    [sys.executable, "-m", "mooncake_cli", "replay", "--url", g.url,
                     "--limit", str(a.requests),
                     "--speed", str((WARMUP_SPEED if warm else a.speed) / a.time_scale),
                     "--time-scale", str(a.time_scale), "--max-output-tokens",
                     str(a.max_output), "--json", out], capture_output=True, text=True)
                print(proc.stdout.strip(), proc.stderr.strip()[-2000:], f"({time.time()-t0:.0f} s)")
                with open(out) as f:
                    res = json.load(f)["results"][0]
                os.unlink(out)
                h1, q1 = hits(prefill)
                c1 = {k: sum(cpu_s(w.proc.pid) for w in ws)
                      for k, ws in (("prefill", prefill), ("decode", decode))}
                c1["gateway"] = cpu_s(g.proc.pid)
                res["cpu_seconds"] = {k: round(c1[k] - c0[k], 1) for k in c0}
                print("cpu seconds", res["cpu_seconds"])
                res["worker_hit_ratio"] = (h1 - h0) / max(1.0, q1 - q0)
                with contextlib.suppress(OSError, ValueError):
                    res["steals"] = scrape(g.url, "mooncake_gateway_steals_total")
                if not warm:
                    res["policy"] = spec
                    res["run"] = run_no
                    runs.append(res)
    keys = ("completed", "rejected", "failed", "ttft_mean_s", "ttft_mean_charged_s",
            "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p90_ms", "slo_attainment",
            "token_hit_ratio", "token_hit_ratio_predicted", "worker_hit_ratio", "steals",
            "wall_seconds")
    print("policy        " + " ".join(f"{k[:12]:>12}" for k in keys))
    for r in runs:
        print(f"{r['policy']:<13} " + " ".join(
            f"{r.get(k):>12.3f}" if isinstance(r.get(k), float) else f"{r.get(k)!s:>12}"
            for k in keys))
    means = {}
    if a.repeats > 1:
        print("means over the repeats")
        for spec in a.policies.split(","):
            mine = [r for r in runs if r["policy"] == spec]
            means[spec] = {k: sum(r[k] for r in mine) / len(mine) for k in keys
                           if all(isinstance(r.get(k), int | float) for r in mine)}
            print(f"{spec:<13} " + " ".join(f"{means[spec].get(k, float('nan')):>12.3f}"
                                            for k in keys))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"settings": vars(a), "results": runs, "means": means}, f, indent=2)
    return 0


def scrape(url: str, name: str) -> float:
    """The sum of a counter's samples on the gateway's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Unavailable as err:  # a missing program: what to install, not a traceback
        sys.exit(f"gateway_e2e: {err} (or run with --no-store)")
