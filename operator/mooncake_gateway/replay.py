"""Replay a Mooncake-format trace against a live gateway, measured client-side.

Each trace ``hash_id`` becomes a deterministic block of :data:`TRACE_BLOCK_TOKENS`
token ids (a PCG64 stream seeded by the id), so prompts share exactly the prefixes the
trace says; a prompt is its blocks' tokens cut to ``input_length``. Requests go to
``/v1/completions`` as token-id prompts with ``stream=True`` and ``max_tokens =
min(output_length, --max-output-tokens)`` at ``timestamp / speed``. TTFT is the time
to the first streamed token; a request's TBT is the mean of the longest
``tbt_top_share`` of its chunk intervals (the simulator's definition). Output has the
same keys as ``simulate --json``; the token hit ratio and prefill GPU seconds come from
the gateway's ``/conductor/state`` counters, read before and after the run, and every
``sample_s`` during it when that is set. Off by default: each read builds the whole state
on the gateway's event loop, and with reads every 2 s the client's SLO attainment came out
0.38–0.39 against the gateway's own 0.46–0.47 in two runs of the monitoring end to end
(without them: 0.45 and 0.45; the cause is not pinned down). Each read names who counts
(``counters.id``) and since when; the increase is summed per counter owner, the way
Prometheus' ``increase()`` treats a reset: a gateway that restarts (or a replica seen for
the first time, started after the run began) counts from zero, so a restart mid-run loses
at most the counts since the last read, and never makes a total negative.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from mooncake_contract.tokenizer import VOCAB_SIZE
from mooncake_sim.metrics import latency_summary
from mooncake_sim.trace import TRACE_BLOCK_TOKENS, TraceRecord

from .slo import request_tbt

#: smallest token id a replayed prompt uses (ids below are the tokenizer's specials)
FIRST_ID = 256
BLOCK_SALT = 0x5EED_B10C


def block_tokens(hash_id: int, size: int = TRACE_BLOCK_TOKENS,
                 salt: int = BLOCK_SALT) -> np.ndarray[Any, Any]:
    """The token ids of trace block ``hash_id``; another ``salt`` gives the same trace
    shape with prefixes no cache has seen (a second replay starts cold)."""
    rng = np.random.Generator(np.random.PCG64([salt, hash_id & ((1 << 63) - 1)]))
    return rng.integers(FIRST_ID, VOCAB_SIZE, size=size, dtype=np.int64)


def prompt_tokens(rec: TraceRecord, cache: dict[int, np.ndarray[Any, Any]],
                  salt: int = BLOCK_SALT) -> list[int]:
    parts = []
    for h in rec.hash_ids:
        b = cache.get(h)
        if b is None:
            b = cache[h] = block_tokens(h, salt=salt)
        parts.append(b)
    return [int(t) for t in np.concatenate(parts)[: rec.input_length]]


@dataclass(slots=True)
class Outcome:
    status: str = "pending"  # ok | rejected | failed
    ttft_s: float = math.nan
    tbt_s: float = math.nan
    intervals: list[float] = field(default_factory=list)
    error: str = ""
    #: times it was sent again after its connection failed before any answer came
    retries: int = 0
    #: wall seconds since the replay's first scheduled send: when sent, when it ended
    sent_s: float = math.nan
    done_s: float = math.nan


@dataclass(slots=True)
class ReplayConfig:
    url: str
    model: str | None = None
    speed: float = 1.0
    max_output_tokens: int = 64
    time_scale: float = 1.0
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    timeout_s: float = 600.0
    #: seeds the block tokens: replays with different salts share no prefix
    salt: int = BLOCK_SALT
    #: called with the number of requests finished so far, after each one
    on_done: Callable[[int], None] | None = None
    #: called once with the ``time.perf_counter()`` of the first scheduled send (the
    #: zero of each outcome's ``sent_s``), before any request goes out
    on_start: Callable[[float], None] | None = None
    #: add each served request's TTFT (``ttft_samples_s``) to the results
    keep_samples: bool = False
    #: add every request's outcome (``outcomes``: sent and ended in wall seconds since
    #: the first send, status, TTFT, error) to the results, e.g. for success per second
    keep_outcomes: bool = False
    #: seconds between reads of the gateway's counters during the run (0: none, only before
    #: and after; set it for runs across gateway restarts)
    sample_s: float = 0.0
    #: reads of ``/conductor/state`` before and after the run, each on a new connection,
    #: so that every gateway replica behind a Service is read (8: a replica of two is
    #: missed with odds of 1 in 128 under random balancing, never under round robin)
    state_reads: int = 8
    #: sent as ``Authorization: Bearer`` on every call (a locked gateway; an admin key
    #: for the hit ratio, which ``/conductor/state`` gives)
    api_key: str | None = None
    #: sends again a request whose connection failed before any answer came (refused,
    #: reset, or closed by a gateway that died), as often as this, after
    #: ``retry_delay_s`` doubling up to ``retry_delay_max_s``: what the OpenAI Python
    #: client does by default (``max_retries=2``, 0.5 s to 8 s). A stream that had begun
    #: is never sent again; its failure counts. The time spent counts in its TTFT.
    retries: int = 2
    retry_delay_s: float = 0.5
    retry_delay_max_s: float = 8.0


class ReplayError(Exception):
    """The gateway refused what the replay needs before it starts (a key, a model)."""


async def _get_json(session: aiohttp.ClientSession, url: str,
                    params: dict[str, str] | None = None,
                    headers: dict[str, str] | None = None) -> Any:
    async with session.get(url, params=params, headers=headers) as r:
        if r.status != 200:
            hint = (" (a locked gateway: put a key in MOONCAKE_API_KEY, an admin key for "
                    "/conductor/state)" if r.status in (401, 403) else "")
            raise ReplayError(f"GET {url} answered {r.status}{hint}: "
                              f"{(await r.read())[:200]!r}")
        return await r.json()


async def _state(session: aiohttp.ClientSession, url: str, model: str,
                 fresh: bool = False) -> dict[str, Any]:
    """The model's state from the gateway at ``url``; ``fresh``: on a connection of its
    own, closed after it (behind a Service, the next read may reach another replica)."""
    data = await _get_json(session, f"{url}/conductor/state", {"model": model},
                           {"Connection": "close"} if fresh else None)
    return dict(data["models"][0])


async def _read_every_replica(session: aiohttp.ClientSession, cfg: ReplayConfig, model: str,
                              counted: CounterIncrease) -> None:
    """``cfg.state_reads`` reads of the state, each on a new connection: every gateway
    replica a Service spreads them over is read (their counters are each their own), so
    each has a first and a last value."""
    for _ in range(cfg.state_reads):
        counted.add(await _state(session, cfg.url, model, fresh=True))


#: the ``/conductor/state`` token counters the results read
COUNTERS = ("prompt", "reused_predicted", "engine_prompt", "engine_cached", "prefill_seconds")


class CounterIncrease:
    """How much the gateway's token counters grew since ``started`` (wall clock), summed
    over every counter owner read (a gateway process, a model's runtime)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self._first: dict[str, dict[str, float]] = {}
        self._last: dict[str, dict[str, float]] = {}
        self.policy = ""

    def add(self, state: dict[str, Any]) -> None:
        owner = state.get("counters") or {"id": "", "since": -math.inf}
        values = {k: float(state["tokens"][k]) for k in COUNTERS}
        oid = str(owner["id"])
        if oid not in self._first:
            # one that began counting after the run started counted only the run
            since = float(owner["since"])
            self._first[oid] = (dict.fromkeys(COUNTERS, 0.0) if since >= self.started
                                else values)
        self._last[oid] = values
        self.policy = str(state["policy"])

    def total(self) -> dict[str, float]:
        return {k: sum(self._last[o][k] - self._first[o][k] for o in self._last)
                for k in COUNTERS}


async def _one(session: aiohttp.ClientSession, cfg: ReplayConfig, body: bytes,
               at: float, out: Outcome, t0: float = 0.0) -> None:
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    out.sent_s = sent - t0
    try:
        await _exchange(session, cfg, body, sent, out)
    finally:
        out.done_s = time.perf_counter() - t0


class _NoAnswer(Exception):
    """The connection failed before any answer came: nothing was streamed, so the
    request may be sent again."""


async def _exchange(session: aiohttp.ClientSession, cfg: ReplayConfig, body: bytes,
                    sent: float, out: Outcome) -> None:
    delay = cfg.retry_delay_s
    while True:
        try:
            await _attempt(session, cfg, body, sent, out)
            return
        except _NoAnswer as exc:
            if out.retries >= cfg.retries:
                out.status, out.error = "failed", str(exc)
                return
        out.retries += 1
        await asyncio.sleep(delay)
        delay = min(2.0 * delay, cfg.retry_delay_max_s)


async def _post(session: aiohttp.ClientSession, cfg: ReplayConfig,
                body: bytes) -> aiohttp.ClientResponse:
    """The request's answer head; :class:`_NoAnswer` when the connection failed first
    (a read timeout is not retried: the server may still be working on it)."""
    try:
        return await session.post(f"{cfg.url}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json"})
    except aiohttp.ServerTimeoutError:
        raise
    except aiohttp.ClientConnectionError as exc:
        raise _NoAnswer(type(exc).__name__) from exc


async def _attempt(session: aiohttp.ClientSession, cfg: ReplayConfig, body: bytes,
                   sent: float, out: Outcome) -> None:
    last = 0.0
    try:
        async with await _post(session, cfg, body) as r:
            if r.status == 429:
                out.status = "rejected"
                await r.read()
                return
            if r.status != 200:
                out.status, out.error = "failed", f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                now = time.perf_counter()
                for ev in events:
                    ev = ev.strip()
                    if not ev.startswith(b"data:") or ev.startswith(b"data: [DONE]"):
                        continue
                    obj = json.loads(ev[5:])
                    if "error" in obj:
                        out.status, out.error = "failed", str(obj["error"])[:200]
                        return
                    if not any(c.get("text") for c in obj.get("choices") or []):
                        continue
                    if math.isnan(out.ttft_s):
                        out.ttft_s = (now - sent) / cfg.time_scale
                    else:
                        out.intervals.append((now - last) / cfg.time_scale)
                    last = now
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.status, out.error = "failed", type(exc).__name__
        return
    if math.isnan(out.ttft_s):
        out.status, out.error = "failed", "no token received"
        return
    out.tbt_s = request_tbt(out.intervals)
    out.status = "ok"


async def replay(records: list[TraceRecord], cfg: ReplayConfig) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout, headers=headers) as session:
        model = cfg.model
        if model is None:
            model = str((await _get_json(session, f"{cfg.url}/v1/models"))["data"][0]["id"])
        cache: dict[int, np.ndarray[Any, Any]] = {}
        bodies = [
            json.dumps({"model": model, "prompt": prompt_tokens(rec, cache, cfg.salt),
                        "stream": True,
                        "max_tokens": max(1, min(rec.output_length, cfg.max_output_tokens))},
                       separators=(",", ":")).encode()
            for rec in records
        ]
        counted = CounterIncrease(time.time())
        await _read_every_replica(session, cfg, model, counted)
        outs = [Outcome() for _ in records]
        t0 = time.perf_counter() + 0.1
        if cfg.on_start is not None:
            cfg.on_start(t0)
        base = records[0].timestamp_ms if records else 0.0
        started = time.perf_counter()
        finished = 0

        async def one(body: bytes, at: float, out: Outcome) -> None:
            nonlocal finished
            await _one(session, cfg, body, at, out, t0)
            finished += 1
            if cfg.on_done is not None:
                cfg.on_done(finished)

        async def sample() -> None:
            while True:
                await asyncio.sleep(cfg.sample_s)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ReplayError,
                                         ValueError, KeyError):
                    counted.add(await _state(session, cfg.url, model))

        sampler = asyncio.get_running_loop().create_task(
            sample() if cfg.sample_s > 0 else asyncio.sleep(0))  # nothing to do when 0
        try:
            await asyncio.gather(*(
                one(body, t0 + (rec.timestamp_ms - base) / 1000.0 / cfg.speed, out)
                for rec, body, out in zip(records, bodies, outs, strict=True)
            ))
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        wall = time.perf_counter() - started
        await _read_every_replica(session, cfg, model, counted)
    return results(records, outs, counted.total(), counted.policy, cfg, wall)


def results(records: list[TraceRecord], outs: list[Outcome], counted: dict[str, float],
            policy: str, cfg: ReplayConfig, wall: float) -> dict[str, Any]:
    """The run's summary; ``counted``: the increase of each of :data:`COUNTERS`."""
    served = [o for o in outs if o.status == "ok"]
    n = len(records)
    eng_prompt, eng_cached = counted["engine_prompt"], counted["engine_cached"]
    pred_prompt, pred_reused = counted["prompt"], counted["reused_predicted"]
    errors: dict[str, int] = {}
    for o in outs:
        if o.status == "failed":
            errors[o.error] = errors.get(o.error, 0) + 1
    return {
        "policy": policy,
        "requests": n,
        "completed": len(served),
        "rejected": sum(1 for o in outs if o.status == "rejected"),
        "failed": sum(1 for o in outs if o.status == "failed"),
        "errors": errors,
        "retried": sum(1 for o in outs if o.retries),
        **latency_summary([(o.ttft_s, o.tbt_s) for o in served], n, cfg.ttft_slo_s,
                          cfg.tbt_slo_s),
        "token_hit_ratio": eng_cached / eng_prompt if eng_prompt else 0.0,
        "token_hit_ratio_predicted": pred_reused / pred_prompt if pred_prompt else 0.0,
        "prefill_gpu_seconds": counted["prefill_seconds"],
        "wall_seconds": wall,
        **({"ttft_samples_s": [o.ttft_s for o in served]} if cfg.keep_samples else {}),
        **({"outcomes": [{"sent_s": o.sent_s, "done_s": o.done_s, "status": o.status,
                          "ttft_s": o.ttft_s, "tbt_s": o.tbt_s, "error": o.error,
                          "retries": o.retries}
                         for o in outs]}
           if cfg.keep_outcomes else {}),
    }
