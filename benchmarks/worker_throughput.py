"""Throughput of one simulated worker (``--time-scale 0``) on one CPU core.

Starts ``mooncake-operator worker`` pinned to one core and, as the ceiling, a plain
aiohttp hello-world server pinned to the same core (returning a completion-sized JSON
body), then drives both with the same aiohttp client (pinned to another core when the
machine has one) at the same concurrency, and prints requests/s and the ratio.

    python benchmarks/worker_throughput.py --requests 20000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

HOST = "127.0.0.1"
HELLO_BODY = {
    "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "llama3-70b-sim",
    "choices": [{"index": 0, "text": " kalo mine ruta vosi peda guzo befi hoju",
                 "logprobs": None, "finish_reason": "length", "stop_reason": None}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16},
}


def hello_server(port: int) -> None:
    """The ceiling: aiohttp doing nothing but parse the body and answer."""
    from aiohttp import web

    payload = json.dumps(HELLO_BODY)

    async def handle(request: web.Request) -> web.Response:
        json.loads(await request.read())
        return web.Response(text=payload, content_type="application/json")

    async def health(_r: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/health", health)
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def pin(core: int | None) -> Callable[[], None] | None:
    if core is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})


def wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("server did not start")


def worker_cmd() -> list[str]:
    exe = shutil.which("mooncake-operator")
    if exe and subprocess.run([exe, "worker", "--help"], capture_output=True).returncode == 0:
        return [exe, "worker"]
    return [sys.executable, "-m", "mooncake_worker"]


async def drive(port: int, requests: int, concurrency: int, body: dict[str, object]) -> float:
    import aiohttp

    url = f"http://{HOST}:{port}/v1/completions"
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    left = requests
    errors = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal left, errors
        while left > 0:
            left -= 1
            async with session.post(url, data=data, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        # warm-up
        left = min(500, requests)
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        left = requests
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{errors} requests failed")
    return requests / elapsed


def start(cmd: list[str], port: int, server_core: int | None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, preexec_fn=pin(server_core), stdout=subprocess.DEVNULL)
    wait_ready(port, proc)
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default="Say hello to the simulated model please")
    ap.add_argument("--serve-hello", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_hello is not None:
        hello_server(args.serve_hello)
        return
    ncpu = os.cpu_count() or 1
    server_core, client_core = (0, 1) if ncpu >= 2 else (None, None)
    if client_core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {client_core})
    body: dict[str, object] = {"model": "llama3-70b-sim", "prompt": args.prompt,
                               "max_tokens": args.max_tokens}

    wport, hport = free_port(), free_port()
    procs = [
        start([*worker_cmd(), "--host", HOST, "--port", str(wport), "--time-scale", "0",
               "--max-waiting", str(max(1024, args.concurrency * 2))], wport, server_core),
        start([sys.executable, __file__, "--serve-hello", str(hport)], hport, server_core),
    ]
    # alternate the two servers so that load from elsewhere on the machine hits both alike
    worker: list[float] = []
    hello: list[float] = []
    try:
        for _ in range(args.rounds):
            worker.append(asyncio.run(drive(wport, args.requests, args.concurrency, body)))
            hello.append(asyncio.run(drive(hport, args.requests, args.concurrency, body)))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    w, h = statistics.median(worker), statistics.median(hello)
    print(f"requests={args.requests} x {args.rounds} rounds, concurrency={args.concurrency}, "
          f"max_tokens={args.max_tokens}, server_core={server_core}, client_core={client_core}")
    print(f"worker (time-scale 0): median {w:8.0f} completions/s  "
          f"(rounds: {', '.join(f'{x:.0f}' for x in worker)})")
    print(f"aiohttp hello-world:   median {h:8.0f} requests/s     "
          f"(rounds: {', '.join(f'{x:.0f}' for x in hello)})")
    print(f"ratio worker/hello:    {w / h:8.2f}")


if __name__ == "__main__":
    main()
