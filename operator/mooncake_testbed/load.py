"""A closed-loop load generator and per-process CPU and memory readings, for benchmarks.

:func:`drive` sends completions from N concurrent loops over one aiohttp session (each
loop sends its next request when the last is answered) and reports latency, req/s and the
CPU a process spent per request, read from ``/proc/PID/stat`` (Linux).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp

from .procs import MODEL

#: the default prompt: ~200 tokens of text
PROMPT = " ".join(f"w{i % 97} x{i}" for i in range(100))
MAX_TOKENS = 8
MS = 1000.0
US = 1e6
KIB = 1024
WARMUP_MAX = 8


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, n: int, conc: int, pid: int | None = None,
                bodies: list[bytes] | None = None) -> dict[str, float]:
    """``n`` requests at concurrency ``conc``: the ``bodies`` in turn (default: one
    :data:`PROMPT`); latency, req/s and CPU µs per request of process ``pid``."""
    each = bodies or [
        json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()]
    lat: list[float] = []
    errors = 0
    left = n
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one_loop() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                req = each[left % len(each)]
                t = time.perf_counter()
                async with s.post(url + "/v1/completions", data=req,
                                  headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                lat.append(time.perf_counter() - t)

        for _ in range(min(conc, WARMUP_MAX)):  # warm-up
            async with s.post(url + "/v1/completions", data=each[0],
                              headers={"Content-Type": "application/json"}) as r:
                await r.read()
        cpu0 = cpu_seconds(pid) if pid is not None else 0.0
        t0 = time.perf_counter()
        await asyncio.gather(*(one_loop() for _ in range(conc)))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(pid) - cpu0 if pid is not None else float("nan")
    lat.sort()
    return {"p50_ms": lat[len(lat) // 2] * MS, "p99_ms": lat[int(0.99 * len(lat))] * MS,
            "rps": len(lat) / wall, "errors": errors, "cpu_us": cpu / len(lat) * US}


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (``VmRSS`` of ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * KIB
    return 0
