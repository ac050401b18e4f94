"""Mooncake-format request traces: load, validate, summarise.

One JSON object per line: ``timestamp`` (ms from start), ``input_length``,
``output_length`` (tokens) and ``hash_ids`` (one id per ``block_tokens``-token
block; equal ids mean equal block and equal whole prefix before it; the last
block may be partial). Anything else stops loading with a :class:`TraceError`
naming the line.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from .gcpause import gc_paused

TRACE_BLOCK_TOKENS = 512
BUNDLED = {"conversation": "conversation_trace.jsonl"}


class TraceError(ValueError):
    """A trace that cannot be replayed; ``str()`` names the file and line."""


@dataclass(slots=True, frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def bundled_trace(name: str = "conversation") -> Path:
    """Path of a trace shipped with the package (the Mooncake conversation trace)."""
    ref = resources.files("mooncake_sim") / "traces" / BUNDLED[name]
    return Path(str(ref))


def _int_field(obj: dict[str, object], key: str, where: str) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TraceError(f"{where}: {key!r} must be a number, got {v!r}")
    if v != int(v):
        raise TraceError(f"{where}: {key!r} must be a whole number of tokens, got {v!r}")
    if v < 0:
        raise TraceError(f"{where}: {key!r} must not be negative, got {v!r}")
    return int(v)


def parse_line(line: str, where: str, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise TraceError(f"{where}: 'timestamp' must be a number of milliseconds, got {ts!r}")
    if ts < 0:
        raise TraceError(f"{where}: 'timestamp' must not be negative, got {ts!r}")
    n_in = _int_field(obj, "input_length", where)
    n_out = _int_field(obj, "output_length", where)
    if n_in == 0:
        raise TraceError(f"{where}: 'input_length' must be at least 1")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or any(
        isinstance(h, bool) or not isinstance(h, int) for h in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
    need = -(-n_in // block_tokens)
    if len(ids) < need:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids cannot cover input_length {n_in} "
            f"({need} blocks of {block_tokens} tokens needed)"
        )
    return TraceRecord(float(ts), n_in, n_out, tuple(ids[:need]))


def _fast_record(line: str, block_tokens: int) -> TraceRecord | None:
    """The record of a well-formed line (integer lengths, integer block ids), checked in
    a few C-level operations; ``None`` for anything else, which :func:`parse_line` then
    reads again and either accepts (e.g. a length written ``600.0``) or names the fault
    of. The checks are :func:`parse_line`'s, so both paths take the same lines."""
    try:  # json.loads without its whitespace scans: a value from the first character...
        obj, end = _scan_once(line, 0)
    except (StopIteration, json.JSONDecodeError):  # (StopIteration: no value there)
        return None
    if end != len(line) and line[end:] != "\n":  # ...and nothing after it but the newline
        return None
    if type(obj) is not dict:
        return None
    ts, n_in, n_out, ids = (obj.get("timestamp"), obj.get("input_length"),
                            obj.get("output_length"), obj.get("hash_ids"))
    if (type(n_in) is not int or type(n_out) is not int or type(ids) is not list
            or not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts)
            or ts < 0 or n_in < 1 or n_out < 0):
        return None
    need = -(-n_in // block_tokens)
    if len(ids) < need or (ids and set(map(type, ids)) != _INT_ONLY):
        return None
    return TraceRecord(float(ts), n_in, n_out, tuple(ids[:need]))


_INT_ONLY = {int}
#: the scanner ``json.loads`` runs (the default decoder's), called directly (an instance
#: attribute the stubs do not declare)
_scan_once: Callable[[str, int], tuple[Any, int]] = \
    json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def load_trace(
    path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS, limit: int | None = None
) -> list[TraceRecord]:
    """Read and validate a whole trace; raise :class:`TraceError` on the first bad line."""
    p = Path(path)
    try:
        fh = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot open ({exc.strerror})") from None
    out: list[TraceRecord] = []
    last_ts = -math.inf
    with fh, gc_paused():
        for lineno, line in enumerate(fh, 1):
            rec = _fast_record(line, block_tokens)
            if rec is None:
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    rec = parse_line(line, where, block_tokens)
                except UnicodeDecodeError:
                    raise TraceError(f"{where}: not UTF-8 text") from None
            if rec.timestamp_ms < last_ts:
                raise TraceError(
                    f"{p}:{lineno}: timestamps must not decrease "
                    f"({rec.timestamp_ms:g} after {last_ts:g})"
                )
            last_ts = rec.timestamp_ms
            out.append(rec)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TraceError(f"{p}: no requests in trace")
    return out


@dataclass(slots=True, frozen=True)
class TraceStats:
    requests: int
    duration_s: float
    rate_per_s: float
    avg_input: float
    avg_output: float
    max_input: int
    distinct_blocks: int
    reuse_ceiling_tokens: float
    reuse_ceiling_blocks: float


def reuse_ceiling(
    records: list[TraceRecord], block_tokens: int = TRACE_BLOCK_TOKENS
) -> tuple[float, float]:
    """Share of input tokens (and of blocks) an unbounded, global cache could reuse: the
    leading blocks of each request already seen in any earlier request."""
    reused_tokens = total_tokens = reused_blocks = total_blocks = 0
    for r, k in seen_prefix_blocks(records):
        reused_tokens += min(k * block_tokens, r.input_length)
        total_tokens += r.input_length
        reused_blocks += k
        total_blocks += len(r.hash_ids)
    return reused_tokens / max(1, total_tokens), reused_blocks / max(1, total_blocks)


def seen_prefix_blocks(records: list[TraceRecord]) -> Iterator[tuple[TraceRecord, int]]:
    """Each request with its count of leading blocks some earlier request already had
    (what an unbounded, global cache could reuse), in trace order."""
    seen: set[int] = set()
    for r in records:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        yield r, k
        seen.update(r.hash_ids)


def trace_stats(records: list[TraceRecord], block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceStats:
    n = len(records)
    duration = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000.0
    tok, blk = reuse_ceiling(records, block_tokens)
    return TraceStats(
        requests=n,
        duration_s=duration,
        rate_per_s=n / duration if duration > 0 else math.inf,
        avg_input=sum(r.input_length for r in records) / n,
        avg_output=sum(r.output_length for r in records) / n,
        max_input=max(r.input_length for r in records),
        distinct_blocks=len({h for r in records for h in r.hash_ids}),
        reuse_ceiling_tokens=tok,
        reuse_ceiling_blocks=blk,
    )


def arrival_tick_ms(records: list[TraceRecord]) -> float:
    """The step a trace's timestamps were rounded to: when most of its requests share
    their timestamp with another, the median gap between its distinct timestamps (3,000
    ms in the bundled conversation trace, whose requests come in groups of about ten);
    0 otherwise (arrivals recorded apart)."""
    counts = Counter(r.timestamp_ms for r in records)
    grouped = sum(n for n in counts.values() if n > 1)
    if len(counts) < 2 or 2 * grouped <= len(records):
        return 0.0
    stamps = sorted(counts)
    return float(statistics.median(b - a for a, b in itertools.pairwise(stamps)))


def spread_arrivals(records: list[TraceRecord], tick_ms: float,
                    seed: int = 0) -> list[TraceRecord]:
    """``records`` with each arrival moved to a uniformly drawn time within the
    ``tick_ms`` after its recorded one, in the new arrival order: the arrivals a trace
    rounded to its tick, spread again (requests recorded at one instant then arrive
    apart, as they did before the rounding)."""
    if tick_ms < 0:
        raise ValueError("tick_ms must be >= 0")
    rng = random.Random(seed)
    moved = [replace(r, timestamp_ms=r.timestamp_ms + rng.uniform(0.0, tick_ms))
             for r in records]
    moved.sort(key=lambda r: r.timestamp_ms)
    return moved
