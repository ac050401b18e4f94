"""The gateway's memory over repeated replays (issues 32 and 36): how far it grows, what
it grows with, and whether it stays flat once warm.

    python benchmarks/gateway_memory.py [--passes 4] [--requests 1000] [--speed 2.0]
        [--time-scale 0.2] [--json OUT] [--markdown OUT]

Two prefill and two decode simulated workers and one gateway (the default Conductor)
on this machine. The first ``--requests`` requests of the bundled conversation trace are
replayed ``--passes`` times, each pass with fresh prompts (another block-key salt), at
``--speed`` times the trace's rate: above 1 the gateway is in overload, holds requests
and answers 429s, so its in-flight requests reach their high-water mark in every pass.
Every second: the gateway's resident memory (``VmRSS``), its index entries (prefill and
decode instances, ``/conductor/state``) and its requests in flight.

Per pass: the largest RSS, the index entries at its end and the most requests in flight.
The gateway is *warm* once its bounded caches are full: after the first pass that ends
with its index full (at least :data:`WARM_SHARE` of the engines' cache size, their
``num_gpu_blocks``, which bounds the index's LRU) and so turning over, and that ends at
least :data:`TRACKED_PREFIXES` requests in (the hot-prefix tracker's bound: it cannot be
full before). *Growth after warm-up* is the largest RSS of the passes after it over the
largest of it, minus one. The page splits the largest RSS above the start into the
index's share (bytes per block, below, times the most blocks it held) and the rest.

*Index and event feed, bytes per block* is measured apart, in this process before
anything starts: KV-event batches of 512-block chains (random token ids, 64-bit engine
hashes), ``--feeder-blocks`` blocks over as many instances, applied through the
gateway's own :class:`~mooncake_gateway.kvindex.IndexFeeder`; RSS growth over blocks.
The rest of pass 1's growth is what the requests in flight and the allocator's
high-water mark hold.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.replication import ReplicationConfig
from mooncake_conductor.warmup import warm_up
from mooncake_contract.kvevents.codec import BlockHash, BlockStored, KVEventBatch
from mooncake_contract.tokenizer import VOCAB_SIZE
from mooncake_gateway.kvindex import IndexFeeder
from mooncake_gateway.replay import ReplayConfig, replay
from mooncake_sim.trace import bundled_trace, load_trace
from mooncake_testbed.load import rss_bytes
from mooncake_testbed.procs import MODEL, GatewayProc, model_config, run_gateway, run_worker
from mooncake_testbed.report import envelope, provenance, publish

SAMPLE_S = 1.0
CHAIN_BLOCKS = 512
BLOCK_SIZE = 16
#: the issue's bar: RSS growth after warm-up
TARGET_GROWTH = 0.10
#: the index's share of the engines' cache size that counts as full (the gateway warm)
WARM_SHARE = 0.99
#: the hot-prefix tracker's bound (the gateway's default configuration): it is full at
#: the earliest after as many requests
TRACKED_PREFIXES = ReplicationConfig().max_tracked
MAX_OUTPUT_TOKENS = 64


def feeder_bytes_per_block(instances: int, blocks: int, seed: int) -> float:
    """RSS growth per block of a :class:`PrefixIndex` fed through an :class:`IndexFeeder`
    with ``blocks`` blocks spread over ``instances`` (see the module docstring)."""
    warm_up()  # numba's compiled loops (tens of MB) are not the index's
    per = max(CHAIN_BLOCKS, blocks // instances)
    index = PrefixIndex(per, instances)
    feeder = IndexFeeder(index, BLOCK_SIZE, seed)
    rng = np.random.default_rng(seed)
    gc.collect()
    before = rss_bytes(os.getpid())
    for iid in range(instances):
        for seq in range(per // CHAIN_BLOCKS):
            hashes: list[BlockHash] = [int(h).to_bytes(8, "big")
                                       for h in rng.integers(1 << 62, 1 << 63, CHAIN_BLOCKS)]
            tokens = rng.integers(256, VOCAB_SIZE, CHAIN_BLOCKS * BLOCK_SIZE).tolist()
            stored = BlockStored(block_hashes=hashes, parent_block_hash=None,
                                 token_ids=tokens, block_size=BLOCK_SIZE)
            feeder.apply(iid, seq, KVEventBatch(ts=0.0, events=[stored]))
    gc.collect()
    return (rss_bytes(os.getpid()) - before) / max(1, len(index))


class Sampler:
    """The gateway's RSS, index entries and requests in flight, every second."""

    def __init__(self, gw: GatewayProc) -> None:
        self.gw = gw
        self.rows: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                st = self.gw.state(MODEL)
                rss = rss_bytes(self.gw.proc.pid)
            except (OSError, ValueError, KeyError):
                continue  # a busy gateway may miss a sample
            insts = st["prefill"] + st["decode"]
            self.rows.append((time.monotonic() - self._t0, rss,
                              sum(int(i["index_blocks"]) for i in insts),
                              sum(int(i["inflight"]) for i in insts)))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(5 * SAMPLE_S)

    def since(self, t: float) -> list[tuple[float, int, int, int]]:
        return [r for r in self.rows if r[0] >= t]

    def now(self) -> float:
        return time.monotonic() - self._t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    records = load_trace(bundled_trace())[: args.requests]
    common = ("--time-scale", str(args.time_scale))
    with ExitStack() as stack:
        workers = [stack.enter_context(run_worker("--role", role, *common))
                   for role in ["prefill"] * args.prefill + ["decode"] * args.decode]
        gw = stack.enter_context(run_gateway([model_config(
            workers[:args.prefill], workers[args.prefill:], MODEL,
            time_scale=args.time_scale)]))
        start_rss = rss_bytes(gw.proc.pid)
        passes: list[dict[str, Any]] = []
        with Sampler(gw) as sampler:
            for p in range(args.passes):
                begun = sampler.now()
                cfg = ReplayConfig(url=gw.url, model=MODEL, speed=args.speed / args.time_scale,
                                   time_scale=args.time_scale,
                                   max_output_tokens=MAX_OUTPUT_TOKENS, salt=args.seed + p)
                res = asyncio.run(replay(records, cfg))
                time.sleep(2 * SAMPLE_S)  # the last samples of the pass
                rows = sampler.since(begun) or sampler.rows[-1:]
                passes.append({
                    "completed": res.get("completed"), "rejected": res.get("rejected"),
                    "failed": res.get("failed"), "errors": res.get("errors") or {},
                    "wall_s": sampler.now() - begun,
                    "peak_rss_bytes": max(r[1] for r in rows),
                    "end_rss_bytes": rows[-1][1], "index_blocks": rows[-1][2],
                    "inflight_max": max(r[3] for r in rows)})
                print(f"  pass {p + 1}/{args.passes}: {res.get('completed')} completed, "
                      f"{res.get('rejected')} rejected; RSS peak "
                      f"{passes[-1]['peak_rss_bytes'] / 1e6:.0f} MB, index "
                      f"{passes[-1]['index_blocks']:,} blocks, in flight at most "
                      f"{passes[-1]['inflight_max']}", file=sys.stderr, flush=True)
            state = gw.state(MODEL)
        capacity = sum(int(i["engine"].get("num_gpu_blocks") or 0)
                       for i in state["prefill"] + state["decode"])
        samples = [list(r) for r in sampler.rows]
    return {"start_rss_bytes": start_rss, "passes": passes, "capacity_blocks": capacity,
            "samples": samples}


def warm_growth(doc: dict[str, Any]) -> tuple[int | None, float | None]:
    """The pass after which the gateway is warm (1-based; ``None``: none) and the growth
    after it (``None``: no pass after it), by the module docstring's rule."""
    r = doc["result"]
    passes, per_pass = r["passes"], doc["settings"]["requests"]
    warm = next((i for i, p in enumerate(passes)
                 if p["index_blocks"] >= WARM_SHARE * r["capacity_blocks"]
                 and (i + 1) * per_pass >= TRACKED_PREFIXES), None)
    if warm is None or warm + 1 >= len(passes):
        return (None if warm is None else warm + 1), None
    later = max(p["peak_rss_bytes"] for p in passes[warm + 1:])
    return warm + 1, later / passes[warm]["peak_rss_bytes"] - 1.0


def markdown(doc: dict[str, Any]) -> str:
    s, r = doc["settings"], doc["result"]
    mb = 1e6
    lines = [
        "# Gateway memory over repeated replays",
        "",
        provenance(doc),
        "",
        f"{s['prefill']} prefill + {s['decode']} decode simulated workers at time scale "
        f"{s['time_scale']:g}, one gateway; the first {s['requests']:,} conversation-trace "
        f"requests at {s['speed']:g}× the trace's rate, {s['passes']} passes, fresh prompts "
        "each pass. Method: `benchmarks/gateway_memory.py` (docstring).",
        "",
        "| pass | completed | 429 | failed | RSS peak | RSS at end | index blocks | "
        "in flight, most |",
        "|---|---|---|---|---|---|---|---|",
        f"| start | | | | {r['start_rss_bytes'] / mb:,.0f} MB | | 0 | |",
    ]
    for i, p in enumerate(r["passes"], 1):
        lines.append(f"| {i} | {p['completed']} | {p['rejected']} | {p['failed']} | "
                     f"{p['peak_rss_bytes'] / mb:,.0f} MB | {p['end_rss_bytes'] / mb:,.0f} MB | "
                     f"{p['index_blocks']:,} | {p['inflight_max']} |")
    warm, g = warm_growth(doc)
    peak = max(p["peak_rss_bytes"] for p in r["passes"])
    in_flight = max(p["inflight_max"] for p in r["passes"])
    held = max(p["index_blocks"] for p in r["passes"])
    index_bytes = doc["feeder_bytes_per_block"] * held
    rest = max(0.0, peak - r["start_rss_bytes"] - index_bytes)
    errors: dict[str, int] = {}
    for p in r["passes"]:
        for kind, n in (p.get("errors") or {}).items():
            errors[kind] = errors.get(kind, 0) + n
    lines += [
        "",
        "- *failed*: the replay's requests that got neither an answer nor a 429"
        + (" (" + "; ".join(f"{n}× {kind[:120]}" for kind, n in
                            sorted(errors.items(), key=lambda e: -e[1])[:3]) + ")"
           if errors else "; their errors were not recorded by this run") + ".",
        f"- The engines' caches hold {r['capacity_blocks']:,} blocks in all (their "
        "`num_gpu_blocks`): the index stops growing there, as the LRU that follows the "
        "engines' evictions bounds it.",
        f"- Above its start, the gateway's largest RSS was "
        f"{(peak - r['start_rss_bytes']) / mb:,.0f} MB: its index and event feed, at "
        f"{doc['feeder_bytes_per_block']:,.0f} B a block (measured apart), "
        f"{index_bytes / mb:,.0f} MB for the {held:,} blocks it held at most; the other "
        f"{rest / mb:,.0f} MB is the requests in flight (at most {in_flight}, so about "
        f"{rest / max(1, in_flight) / 1e3:,.0f} kB each with these prompts) and what the "
        "allocator keeps of them and of the index's turnover.",
    ]
    if warm is not None and g is not None:
        met = g <= TARGET_GROWTH
        lines.append(f"- Warm after pass {warm} (its index full, {100 * WARM_SHARE:.0f}% of "
                     f"the engines' caches or more, and {TRACKED_PREFIXES:,} requests or more "
                     "sent, the hot-prefix tracker's bound). Growth after warm-up (the "
                     f"largest RSS of passes {warm + 1}–{len(r['passes'])} over pass "
                     f"{warm}'s): "
                     f"**{100 * g:+.1f}%**; the bar is {100 * TARGET_GROWTH:.0f}%: "
                     f"{'met' if met else 'not met'}.")
    else:
        lines.append("- No pass after the gateway was warm (its index full and "
                     f"{TRACKED_PREFIXES:,} requests sent): growth after warm-up not measured "
                     "(more --requests or --passes).")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--speed", type=float, default=2.0,
                    help="times the trace's request rate, in modelled time")
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1000, help="block-key salt of pass 1")
    ap.add_argument("--feeder-blocks", type=int, default=300_000,
                    help="blocks of the index-and-feed measurement")
    ap.add_argument("--json", dest="json_out", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--from-json", type=Path,
                    help="only write the page from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json is not None:
        doc = json.loads(args.from_json.read_text())
        publish(doc, markdown(doc), None, args.markdown)
        return 0
    if min(args.passes, args.requests, args.prefill, args.decode, args.feeder_blocks) < 1:
        ap.error("--passes, --requests, --prefill, --decode and --feeder-blocks must be at "
                 "least 1")
    if args.speed <= 0 or args.time_scale <= 0:
        ap.error("--speed and --time-scale must be positive")
    started = time.time()
    per_block = feeder_bytes_per_block(args.prefill + args.decode, args.feeder_blocks,
                                       args.seed)
    print(f"  index and event feed: {per_block:,.0f} B per block", file=sys.stderr, flush=True)
    result = run(args)
    doc = envelope("gateway_memory.py", started,
                   {k: getattr(args, k) for k in ("passes", "requests", "speed", "time_scale",
                                                  "prefill", "decode", "seed",
                                                  "feeder_blocks")},
                   result=result, feeder_bytes_per_block=per_block)
    publish(doc, markdown(doc), args.json_out, args.markdown, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
