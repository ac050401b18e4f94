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


def measure(cmd: list[str], port: int, server_core: int | None, args: argparse.Namespace,
            body: dict[str, object]) -> float:
    proc = subprocess.Popen(cmd, preexec_fn=pin(server_core), stdout=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        return asyncio.run(drive(port, args.requests, args.concurrency, body))
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
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

    port = free_port()
    worker = measure(
        [*worker_cmd(), "--host", HOST, "--port", str(port), "--time-scale", "0",
         "--max-waiting", str(max(1024, args.concurrency * 2))],
        port, server_core, args, body,
    )
    port = free_port()
    hello = measure([sys.executable, __file__, "--serve-hello", str(port)],
                    port, server_core, args, body)
    print(f"requests={args.requests} concurrency={args.concurrency} "
          f"max_tokens={args.max_tokens} server_core={server_core} client_core={client_core}")
    print(f"worker (time-scale 0): {worker:8.0f} completions/s")
    print(f"aiohttp hello-world:   {hello:8.0f} requests/s")
    print(f"ratio worker/hello:    {worker / hello:8.2f}")


if __name__ == "__main__":
    main()
