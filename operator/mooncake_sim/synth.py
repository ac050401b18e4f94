"""Synthetic Mooncake-format workloads, to test policies on traces we were not given.

A workload is a stream of multi-turn sessions. Each session picks a system
prompt from a shared pool (Zipf popularity), then sends turns; turn ``k``'s
prompt is the system prompt, every earlier turn's prompt and answer, and a
new user message, so turns share their whole history as a prefix — the shape
of chat and agent traffic. Requests arrive as a Poisson process; sessions
interleave. ``hash_ids`` are assigned the way the released traces do: one id
per 512-token block, equal ids exactly when the block and everything before
it are equal.

Shapes (named after the paper's Table 2 workloads; the generator reproduces
their broad statistics, not their exact content):

- ``conversation``: chat histories, ~12.5k-token inputs, ~43% reusable.
- ``toolagent``: shorter prompts behind shared tool/system prompts, higher
  rate, ~9.3k tokens, ~59% reusable.
- ``synthetic``: long prompts, few turns, ~14.8k tokens, ~50% reusable.

And two shapes that are not from the paper:

- ``shared-doc`` (hot-prefix replication): a few long shared documents (24k tokens, four
  of them, steep Zipf popularity) each asked short questions; most sessions are one
  turn, so nearly all reuse is of the hot documents.
- ``long-output`` (decode-bound): chat with long answers (~1,500 tokens, reasoning
  style) behind ~4k-token questions, so the decode pool, not prefill, is the limit.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from .trace import TRACE_BLOCK_TOKENS, TraceRecord


@dataclass(frozen=True, slots=True)
class Shape:
    system_prompts: int
    system_tokens: int
    zipf_s: float
    turns_mean: float
    user_tokens_mean: float
    output_tokens_mean: float
    rate_per_s: float
    max_input: int


SHAPES: dict[str, Shape] = {
    "conversation": Shape(8, 1024, 1.1, 2.0, 7000.0, 340.0, 3.4, 128_000),
    "toolagent": Shape(24, 3000, 1.2, 2.2, 3500.0, 180.0, 6.5, 64_000),
    "synthetic": Shape(6, 6000, 1.0, 1.6, 7000.0, 150.0, 1.1, 128_000),
    "shared-doc": Shape(4, 24_000, 1.5, 1.2, 1500.0, 200.0, 2.0, 64_000),
    "long-output": Shape(8, 1024, 1.1, 2.0, 4000.0, 1500.0, 3.4, 64_000),
}
#: the shapes named after the paper's Table 2 workloads
PAPER_SHAPES = ("conversation", "toolagent", "synthetic")


def generate(shape: str, requests: int, seed: int = 1) -> list[TraceRecord]:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if requests <= 0:
        raise ValueError("requests must be positive")
    sh = SHAPES[shape]
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** sh.zipf_s for i in range(sh.system_prompts)]
    next_segment = [sh.system_prompts]
    block_ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def new_segment() -> int:
        next_segment[0] += 1
        return next_segment[0]

    def lognormal(mean: float) -> int:
        sigma = 0.8
        mu = math.log(mean) - sigma * sigma / 2
        return max(16, int(rng.lognormvariate(mu, sigma)))

    def hash_ids(pieces: list[tuple[int, int]]) -> list[int]:
        ids: list[int] = []
        parent = -1
        block: list[tuple[int, int, int]] = []
        used = 0
        for seg, length in pieces:
            off = 0
            while off < length:
                take = min(length - off, TRACE_BLOCK_TOKENS - used)
                block.append((seg, off, off + take))
                off += take
                used += take
                if used == TRACE_BLOCK_TOKENS:
                    parent = block_ids.setdefault((parent, tuple(block)), len(block_ids))
                    ids.append(parent)
                    block, used = [], 0
        if block:
            ids.append(block_ids.setdefault((parent, tuple(block)), len(block_ids)))
        return ids

    # sessions: (history pieces, turns left); pick the active session for each request
    active: list[tuple[list[tuple[int, int]], int]] = []
    out: list[TraceRecord] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(sh.rate_per_s)
        start_new = not active or rng.random() < 1.0 / sh.turns_mean
        if start_new:
            sys_id = rng.choices(range(sh.system_prompts), weights)[0]
            turns = 1 + int(rng.expovariate(1.0 / max(1e-9, sh.turns_mean - 1)))
            active.append(([(sys_id, sh.system_tokens)], turns))
            idx = len(active) - 1
        else:
            idx = rng.randrange(len(active))
        history, left = active[idx]
        pieces = [*history, (new_segment(), lognormal(sh.user_tokens_mean))]
        n_in = sum(n for _, n in pieces)
        if n_in > sh.max_input:
            pieces = [history[0], pieces[-1]]
            n_in = sum(n for _, n in pieces)
        n_out = lognormal(sh.output_tokens_mean)
        out.append(TraceRecord(round(t * 1000.0, 3), n_in, n_out, tuple(hash_ids(pieces))))
        history = [*pieces, (new_segment(), n_out)]
        if left <= 1:
            active.pop(idx)
        else:
            active[idx] = (history, left - 1)
    return out


def write_trace(records: list[TraceRecord], path: Path) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps({
                "timestamp": int(r.timestamp_ms), "input_length": r.input_length,
                "output_length": r.output_length, "hash_ids": list(r.hash_ids),
            }) + "\n")
