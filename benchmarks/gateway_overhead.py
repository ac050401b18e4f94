"""Added latency of the gateway over a direct call to a worker, and peak req/s.

    python benchmarks/gateway_overhead.py [--requests 2000] [--concurrency 1,16,64]
        [--rounds 1] [--targets direct,gateway,...] [--json OUT]
        [--routers /path/to/venv/bin]   # where sglang-router / vllm-router live
        [--baseline TREE]   # also the gateway of another source tree, same run

Two simulated workers (``--time-scale 0``: the engine answers as fast as the CPU allows)
serve every target. Targets, each driven by the same closed-loop client (aiohttp, N
requests at a fixed concurrency, a ~200-token text prompt, ``max_tokens`` 8,
non-streamed):

- ``direct``: the worker itself;
- ``gateway``: our gateway, single hop (the ``direct`` rule sends every prompt straight
  to a decode instance: routing decision + one upstream call, like the routers below);
- ``gateway-pd``: our gateway with P/D (prefill ``max_tokens=1`` then decode: two calls);
- ``sglang-router`` / ``vllm-router`` (``cache_aware``), when installed.

Added latency = target's p50/p99 minus direct's at the same concurrency; peak req/s =
highest throughput over the concurrencies. ``cpu us`` = CPU seconds (user + system, all
threads) the target's process spent per request during the measured requests — for
``direct`` the worker's, for the others the router's own (the workers' not included): less
noisy than latency on a shared machine. ``--targets`` picks some of the targets.

Every target is started first; then each concurrency is measured on every target in turn,
``--rounds`` times over, so a change in the machine's load falls on all of them alike.
``--baseline TREE`` runs a second gateway from another source tree (its ``operator/`` and
``worker/`` first on ``PYTHONPATH``) as ``gateway-baseline``: before and after a change in
one run, e.g. ``git archive OLD operator worker | tar -x -C /tmp/old``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mooncake_testbed.load import drive
from mooncake_testbed.procs import HOST, MODEL, free_port, model_config, run_gateway, run_worker

START_TIMEOUT_S = 30
TARGETS = ("direct", "gateway", "gateway-pd", "sglang-router", "vllm-router")
#: the PyPI distribution that ships each peer router's binary
ROUTER_PACKAGES = {"sglang-router": "sglang-router", "vllm-router": "vllm-router"}


@dataclass
class Target:
    url: str
    pid: int


@contextlib.contextmanager
def router(cmd: list[str], port: int) -> Iterator[Target]:
    log = open(f"/tmp/router-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited; see {log.name}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    urllib.request.Request(url + "/v1/completions", data=json.dumps(
                        {"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode(),
                        headers={"Content-Type": "application/json"}), timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not start; see {log.name}")
            time.sleep(0.2)
        yield Target(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every target at every concurrency this many times")
    ap.add_argument("--routers", default=None, help="bin folder with sglang-router/vllm-router")
    ap.add_argument("--baseline", default=None, metavar="TREE",
                    help="a source tree (operator/ and worker/, e.g. `git archive` of an "
                         "older commit) whose gateway runs too, as target gateway-baseline")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--gateway-settings", default="{}",
                    help='extra gateway settings as JSON, e.g. \'{"fast_front": false}\'')
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"comma-separated subset of {','.join(TARGETS)}")
    a = ap.parse_args()
    concs = [int(c) for c in a.concurrency.split(",")]
    wanted = set(a.targets.split(","))
    wanted.add("direct")  # the baseline of every "+" column
    if a.baseline:
        wanted.add("gateway-baseline")
    bindir = a.routers
    results: dict[str, dict[int, list[dict[str, float]]]] = {}
    fast = ("--time-scale", "0", "--max-waiting", "100000")
    with run_worker(*fast) as w1, run_worker(*fast) as w2, contextlib.ExitStack() as stack:
        urls = [w1.url, w2.url]
        targets: list[tuple[str, Any]] = [
            ("direct", contextlib.nullcontext(Target(w1.url, w1.proc.pid)))]
        single = model_config([w1, w2], [w1, w2], conductor={"policy": "conductor"},
                              direct={"uncached_tokens_below": 1 << 30})
        pd = model_config([w1], [w2], conductor={"policy": "conductor"})
        extra = json.loads(a.gateway_settings)
        targets.append(("gateway", lambda: run_gateway([single], **extra)))
        if a.baseline:
            tree = os.path.abspath(a.baseline)
            env = {"PYTHONPATH": os.pathsep.join(
                (os.path.join(tree, "operator"), os.path.join(tree, "worker")))}
            targets.append(("gateway-baseline",
                            lambda: run_gateway([single], env=env, **extra)))
        targets.append(("gateway-pd", lambda: run_gateway([pd], **extra)))
        if bindir:
            sg = os.path.join(bindir, "sglang-router")
            vr = os.path.join(bindir, "vllm-router")
            if shutil.which(sg):
                p = free_port()
                targets.append(("sglang-router", lambda p=p: router(
                    [sg, "launch", "--worker-urls", *urls, "--policy", "cache_aware",
                     "--host", HOST, "--port", str(p), "--prometheus-host", HOST,
                     "--prometheus-port", str(free_port()), "--log-level", "error"], p)))
            if shutil.which(vr):
                p = free_port()
                targets.append(("vllm-router", lambda p=p: router(
                    [vr, "--worker-urls", *urls, "--policy", "cache_aware", "--host", HOST,
                     "--port", str(p), "--prometheus-host", HOST,
                     "--prometheus-port", str(free_port())], p)))
        found = {name for name, _ in targets}
        for name, pkg in ROUTER_PACKAGES.items():
            if name in wanted and name not in found:
                print(f"{name}: not measured; install it (pip install {pkg}) into a venv and "
                      "pass its bin folder with --routers", file=sys.stderr)
        # every target up at once, then measured in turn at each concurrency, round after
        # round: a change in the machine's load falls on all of them alike
        running: list[tuple[str, Target]] = []
        for name, make in targets:
            if name not in wanted:
                continue
            try:
                target = stack.enter_context(make() if callable(make) else make)
            except RuntimeError as exc:
                print(f"{name}: {exc}")
                continue
            if not isinstance(target, Target):
                target = Target(target.url, target.proc.pid)
            running.append((name, target))
        for _ in range(a.rounds):
            for c in concs:
                for name, target in running:
                    row = asyncio.run(drive(target.url, a.requests, c, target.pid))
                    results.setdefault(name, {}).setdefault(c, []).append(row)
    base = results.get("direct", {})
    print(f"{'target':<16} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} "
          f"{'+p99 ms':>8} {'req/s':>8} {'cpu us':>7} {'errors':>6}")
    for name, rows in results.items():
        for c, runs in rows.items():
            for i, r in enumerate(runs):
                b = base.get(c, runs)[i]
                print(f"{name:<16} {c:>4} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                      f"{r['p50_ms'] - b['p50_ms']:>8.2f} {r['p99_ms'] - b['p99_ms']:>8.2f} "
                      f"{r['rps']:>8.0f} {r['cpu_us']:>7.0f} {int(r['errors']):>6}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
