"""The gateway in front of a fleet: 256 simulated workers, req/s, CPU per request, memory.

    python benchmarks/gateway_fleet.py [--workers 256] [--hosts 4] [--mode single|pd]
        [--concurrency 64] [--requests 20000] [--prompts 1024] [--json OUT]
        [--baseline TREE]   # then the gateway of another source tree, same workers

``--workers`` simulated engines at ``--time-scale 0`` (the worker's fast mode: answers as
fast as the CPU allows) behind one gateway running the ``conductor`` policy. A worker
process rests at ~65 MB, so 256 of them would take ~16 GB; instead ``--hosts`` processes
each run their share of the workers on one event loop (``mooncake_worker.server.serve``
once per worker: its own engine, KV-event publisher, metrics and HTTP port, ~0.1 MB
each), so every engine is still a separate instance on its own port. ``--mode single``
lists every worker as a prefill and as a decode instance with the ``direct`` rule on
(one upstream call per request, as ``gateway`` in ``gateway_overhead.py``: 2 x workers
instances); ``pd`` splits them half prefill, half decode (two calls per request).

The closed-loop client (``mooncake_testbed.load.drive``) sends ``--requests`` completions at
``--concurrency``, each one of ``--prompts`` distinct ~200-token prompts in turn (so the
prefix index holds that many prompts spread over the fleet), after one unmeasured pass
over them. Reported: req/s and latency, the gateway's CPU (user + system, all threads,
``/proc/PID/stat``) per request during the measured requests and per second at rest
(health checks and ``/metrics`` scrapes of every instance), its RSS at rest (every
instance registered, before any request) and at the end, and the instances it counts
routable (``mooncake_gateway_routable_instances``), and the worker processes' CPU per
request. ``--baseline TREE`` measures a second gateway the same way afterwards (on a
fresh set of workers: no KV-event history), e.g. the code before a change from
``git archive OLD operator worker | tar -x -C /tmp/old``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from mooncake_testbed.load import cpu_seconds, drive, rss_bytes
from mooncake_testbed.procs import HOST, MODEL, free_port, run_gateway, stop_process

HOST_READY = "ready"
START_TIMEOUT_S = 120.0
REST_S = 5.0
REGISTER_TIMEOUT_S = 120.0
MIB = 1 << 20
US = 1e6
WORKER_ARGS = {"time_scale": 0, "max_waiting": 100000}


# -- worker hosts ------------------------------------------------------------------------------

def host_main(spec: str) -> int:
    """Run the workers ``spec`` lists (JSON ``[[http, kv_events, kv_replay], ...]``) on one
    event loop; print :data:`HOST_READY` once every one listens."""
    import uvloop
    from mooncake_worker.server import serve
    from mooncake_worker.settings import WorkerSettings

    ports = json.loads(spec)

    async def run() -> None:
        listening = 0
        done = asyncio.Event()

        def ready(_port: int) -> None:
            nonlocal listening
            listening += 1
            if listening == len(ports):
                done.set()

        tasks = [asyncio.create_task(serve(WorkerSettings(
            host=HOST, port=p, kv_events_port=kv, kv_replay_port=rp, **WORKER_ARGS), ready))
            for p, kv, rp in ports]
        await done.wait()
        print(HOST_READY, flush=True)
        await asyncio.gather(*tasks)

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(run())
    return 0


@contextlib.contextmanager
def worker_hosts(n_workers: int, n_hosts: int
                 ) -> Iterator[tuple[list[dict[str, str]], list[int]]]:
    """``n_workers`` workers over ``n_hosts`` processes; yields their gateway endpoints and
    the processes' ids."""
    ports = [(free_port(), free_port(), free_port()) for _ in range(n_workers)]
    shares = [ports[i::n_hosts] for i in range(n_hosts)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for share in shares:
            if share:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--_host", json.dumps(share)],
                    stdout=subprocess.PIPE))
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode().strip()
            if line != HOST_READY:
                raise RuntimeError(f"a worker host did not start (exit {proc.poll()})")
        yield ([{"url": f"http://{HOST}:{p}", "kv_events": f"tcp://{HOST}:{kv}",
                 "kv_replay": f"tcp://{HOST}:{rp}"} for p, kv, rp in ports],
               [proc.pid for proc in procs])
    finally:
        for proc in procs:
            stop_process(proc)


# -- the gateway -------------------------------------------------------------------------------

def routable(url: str) -> dict[str, int]:
    """``mooncake_gateway_routable_instances`` by role, from the gateway's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("mooncake_gateway_routable_instances{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            out[role] = int(float(line.rsplit(" ", 1)[1]))
    return out


def wait_registered(url: str, want: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while True:
        got = routable(url)
        if all(got.get(role, 0) >= n for role, n in want.items()):
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"instances not registered in time: {got}, want {want}")
        time.sleep(0.5)


def prompts(n: int) -> list[bytes]:
    """``n`` distinct ~200-token completion bodies (a distinct first word each)."""
    return [json.dumps({"model": MODEL, "prompt": f"p{k} " + " ".join(
        f"w{i % 97} x{i}" for i in range(100)), "max_tokens": 8}).encode() for k in range(n)]


def measure(a: argparse.Namespace, model: dict[str, Any], host_pids: list[int],
            env: dict[str, str] | None) -> dict[str, Any]:
    """One gateway (``env``: its environment, e.g. another tree on ``PYTHONPATH``) in
    front of the fleet: registration, rest, then the measured requests."""
    want = {"prefill": len(model["prefill"]), "decode": len(model["decode"])}
    t1 = time.monotonic()
    with run_gateway([model], wait_ready=False, env=env,
                     **json.loads(a.gateway_settings)) as g:
        pid = g.proc.pid
        got = wait_registered(g.url, want)
        registered_s = time.monotonic() - t1
        rss_rest = rss_bytes(pid)
        c0 = cpu_seconds(pid)
        time.sleep(REST_S)
        rest_cpu = (cpu_seconds(pid) - c0) / REST_S
        bodies = prompts(a.prompts)
        asyncio.run(drive(g.url, len(bodies), a.concurrency, pid, bodies=bodies))
        w0 = sum(cpu_seconds(p) for p in host_pids)
        r = asyncio.run(drive(g.url, a.requests, a.concurrency, pid, bodies=bodies))
        workers_cpu_us = (sum(cpu_seconds(p) for p in host_pids) - w0) / a.requests * US
        rss_end = rss_bytes(pid)
        got_end = routable(g.url)
    return {"instances": got, "instances_end": got_end, "registered_s": registered_s,
            "rest_cpu_share": rest_cpu, "rss_rest_mib": rss_rest / MIB,
            "rss_end_mib": rss_end / MIB, "workers_cpu_us": workers_cpu_us, **r}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--hosts", type=int, default=4, help="processes the workers run in")
    ap.add_argument("--mode", choices=("single", "pd"), default="single")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--gateway-settings", default="{}", help="extra gateway settings (JSON)")
    ap.add_argument("--baseline", default=None, metavar="TREE",
                    help="then the same with the gateway of another source tree (its "
                         "operator/ and worker/ first on PYTHONPATH), as gateway-baseline")
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--_host", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._host is not None:
        return host_main(a._host)
    variants: list[tuple[str, dict[str, str] | None]] = [("gateway", None)]
    if a.baseline:
        tree = os.path.abspath(a.baseline)
        variants.append(("gateway-baseline", {"PYTHONPATH": os.pathsep.join(
            (os.path.join(tree, "operator"), os.path.join(tree, "worker")))}))
    runs: dict[str, dict[str, Any]] = {}
    for name, env in variants:  # fresh workers for each: no KV history from the last
        t0 = time.monotonic()
        with worker_hosts(a.workers, a.hosts) as (eps, host_pids):
            started_s = time.monotonic() - t0
            if a.mode == "single":
                model: dict[str, Any] = {"name": MODEL, "prefill": eps, "decode": eps,
                                         "direct": {"uncached_tokens_below": 1 << 30}}
            else:
                half = len(eps) // 2
                model = {"name": MODEL, "prefill": eps[:half], "decode": eps[half:]}
            model["conductor"] = {"policy": "conductor"}
            runs[name] = measure(a, model, host_pids, env)
            hosts_rss = sum(rss_bytes(p) for p in host_pids)
    print(f"{a.workers} workers in {a.hosts} processes (started in {started_s:.1f} s), "
          f"mode {a.mode}, concurrency {a.concurrency}, {a.requests} requests over "
          f"{a.prompts} prompts; the worker processes' RSS {hosts_rss / MIB:.0f} MiB in all")
    for name, r in runs.items():
        got = r["instances"]
        print(f"{name}: {got.get('prefill', 0)} prefill + {got.get('decode', 0)} decode "
              f"instances routable after {r['registered_s']:.1f} s ({r['instances_end']} at "
              f"the end); at rest {100 * r['rest_cpu_share']:.1f}% of a core, RSS "
              f"{r['rss_rest_mib']:.0f} MiB")
        print(f"{name}: {r['rps']:.0f} req/s, p50 {r['p50_ms']:.2f} ms, p99 "
              f"{r['p99_ms']:.2f} ms, {r['cpu_us']:.0f} us CPU per request, RSS at the end "
              f"{r['rss_end_mib']:.0f} MiB, errors {int(r['errors'])}; the workers' "
              f"processes {r['workers_cpu_us']:.0f} us CPU per request")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"workers": a.workers, "hosts": a.hosts, "mode": a.mode,
                       "concurrency": a.concurrency, "requests": a.requests,
                       "prompts": a.prompts, "workers_start_s": started_s,
                       "workers_rss_mib": hosts_rss / MIB, "runs": runs},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
