"""Kubernetes API clients side by side, against the embedded cluster's API server.

    python benchmarks/kube_clients.py [--requests 400] [--concurrency 16] [--json out.json]

Measures, for each client, on the same API server in one run: the import time (a fresh
interpreter), GET latency one at a time (p50, p99), GETs per second with
``--concurrency`` in flight, and the client process's CPU per GET. Clients:

- ``mooncake_kube``: the project's one client (``KubeClient`` over the ``kubernetes``
  package's ApiClient, pooled connections, a thread per call for asyncio callers);
- ``urllib``: a new TLS connection per request, as the embedded cluster's own client did
  before it moved onto ``mooncake_kube`` (a reference, not a candidate);
- ``kubernetes_asyncio`` and ``kr8s``: the asyncio clients issue 33 named, when
  installed (``pip install kubernetes_asyncio kr8s``); each reads raw JSON, as ours does.

The benchmark starts its own small local cluster (``--cluster-name``) and purges it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mooncake_localcluster import cluster
from mooncake_localcluster.cluster import StatePaths
from mooncake_localcluster.settings import LocalClusterSettings

NAMESPACE = "default"
OBJECT = "bench-object"
GET_PATH = f"/api/v1/namespaces/{NAMESPACE}/configmaps/{OBJECT}"
IMPORTS = {"mooncake_kube": "import mooncake_kube.client, kubernetes.client",
           "urllib": "import urllib.request, ssl",
           "kubernetes_asyncio": "import kubernetes_asyncio.client",
           "kr8s": "import kr8s.asyncio"}

Get = Callable[[], Awaitable[Any]]
Close = Callable[[], Awaitable[None]]


def cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def import_s(statement: str) -> float | None:
    """Wall seconds of ``statement`` in a fresh interpreter (best of three)."""
    best = None
    for _ in range(3):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", statement], capture_output=True)
        took = time.perf_counter() - started
        if done.returncode != 0:
            return None
        best = took if best is None else min(best, took)
    return best


async def measure(get: Get, requests: int, concurrency: int) -> dict[str, float]:
    for _ in range(10):  # warm: connections, caches
        await get()
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        await get()
        latencies.append(time.perf_counter() - started)
    latencies.sort()
    left = [requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await get()

    cpu0, wall0 = cpu_s(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - wall0, cpu_s() - cpu0
    return {"p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
            "per_s": requests / wall, "cpu_ms_per_get": 1e3 * cpu / requests}


# -- the clients -------------------------------------------------------------------------------
async def ours(kubeconfig: Path, server: str, paths: StatePaths) -> tuple[Get, Close]:
    from kubernetes import config
    from mooncake_kube.client import KubeClient

    client = KubeClient(config.new_client_from_config(config_file=str(kubeconfig)))

    async def close() -> None:
        client.close()
    return (lambda: client.request("GET", GET_PATH)), close


async def plain_urllib(kubeconfig: Path, server: str, paths: StatePaths) -> tuple[Get, Close]:
    ctx = ssl.create_default_context(cafile=str(paths.pki.ca_crt))
    ctx.load_cert_chain(str(paths.pki.admin_crt), str(paths.pki.admin_key))

    def get() -> Any:
        req = urllib.request.Request(server + GET_PATH, headers={"Accept": "application/json"})
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return json.loads(resp.read())

    async def close() -> None:
        return None
    return (lambda: asyncio.to_thread(get)), close


async def k8s_asyncio(kubeconfig: Path, server: str, paths: StatePaths) -> tuple[Get, Close]:
    from kubernetes_asyncio import client, config

    api_client = await config.new_client_from_config(config_file=str(kubeconfig))
    core = client.CoreV1Api(api_client)

    async def get() -> Any:
        resp = await core.read_namespaced_config_map(OBJECT, NAMESPACE, _preload_content=False)
        return json.loads(await resp.read())
    return get, api_client.close


async def kr8s_client(kubeconfig: Path, server: str, paths: StatePaths) -> tuple[Get, Close]:
    import kr8s.asyncio

    api = await kr8s.asyncio.api(kubeconfig=str(kubeconfig))

    async def get() -> Any:
        async with api.call_api("GET", version="v1", base="/api", namespace=NAMESPACE,
                                url=f"configmaps/{OBJECT}") as resp:
            return resp.json()

    async def close() -> None:
        return None
    return get, close


CLIENTS = {"mooncake_kube": ours, "urllib": plain_urllib, "kubernetes_asyncio": k8s_asyncio,
           "kr8s": kr8s_client}


async def run_all(kubeconfig: Path, server: str, paths: StatePaths, requests: int,
                  concurrency: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, make in CLIENTS.items():
        took = import_s(IMPORTS[name])
        if took is None:
            print(f"  {name}: not installed, skipped", flush=True)
            out[name] = {"installed": False}
            continue
        print(f"  {name}: measuring ...", flush=True)
        get, close = await make(kubeconfig, server, paths)
        try:
            row = await measure(get, requests, concurrency)
        finally:
            await close()
        out[name] = {"installed": True, "import_s": took, **row}
    return out


def table(rows: dict[str, dict[str, Any]], concurrency: int) -> str:
    base = rows["mooncake_kube"]
    lines = [f"{'client':<20} {'import s':>9} {'GET p50 ms':>11} {'GET p99 ms':>11} "
             f"{'GET/s @' + str(concurrency):>10} {'CPU ms/GET':>11} {'GET/s vs ours':>14}"]
    for name, r in rows.items():
        if not r["installed"]:
            lines.append(f"{name:<20} not installed")
            continue
        lines.append(f"{name:<20} {r['import_s']:>9.2f} {r['p50_ms']:>11.2f} "
                     f"{r['p99_ms']:>11.2f} {r['per_s']:>10.0f} {r['cpu_ms_per_get']:>11.2f} "
                     f"{r['per_s'] / base['per_s']:>13.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    settings = LocalClusterSettings(name=args.cluster_name, state_dir=args.state_dir,
                                    prefill_nodes=1, decode_nodes=1)
    print(f"starting local cluster {args.cluster_name!r} ...", flush=True)
    info = cluster.up(settings, lambda m: None)
    try:
        paths = cluster.state_paths(settings)
        http = cluster.kube_client(paths, info.server)
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": OBJECT},
                "data": {f"k{i}": "v" * 64 for i in range(20)}}
        http.post(f"/api/v1/namespaces/{NAMESPACE}/configmaps", body)
        rows = asyncio.run(run_all(Path(info.kubeconfig), info.server, paths, args.requests,
                                   args.concurrency))
    finally:
        cluster.down(settings, lambda m: None)
        cluster.purge(settings, lambda m: None)
    print()
    print(f"{args.requests} GETs of one ConfigMap each way; same API server, one run")
    print(table(rows, args.concurrency))
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": args.requests,
                                               "concurrency": args.concurrency,
                                               "clients": rows}, indent=2))
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cluster-name", default="kubebench")
    p.add_argument("--state-dir", type=Path,
                   default=Path(tempfile.gettempdir()) / "mooncake-kubebench")
    p.add_argument("--json")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse()))
