"""Decision latency: token ids → block keys (block size 16) → Conductor decision.

    python benchmarks/gateway_decision.py [--instances 64] [--blocks 1000000]
        [--tokens 8192] [--rounds 10000] [--policy conductor] [--no-churn] [--no-pending]
        [--no-gc-freeze] [--groups 1] [--no-hot-tokens] [--no-candidates] [--min-pool 128]
        [--compare] [--no-load-churn]

The index holds ``--blocks`` keys spread over ``--instances`` prefill instances (chained
prefixes of 512 blocks, every tenth one shared by several instances), queues are non-empty,
and each request shares a random-length prefix with an indexed chain (made just
before its decision: fresh token ids, as from a tokenizer); decode instances run
batches of 0-32 sequences. Every queued prefill's prompt (8k tokens, a random part of
it shared with a chain) is pending on its instance (``--pending``, default on), so
matching reads both the stored and the in-flight view. Timed per request:
``block_keys`` over the token ids (numpy) + ``Conductor.schedule`` (prefill policy,
decode selector, admission, hot-prefix record) — what the gateway does between
tokenizing and dispatching. Target: p99 < 200 µs for 8k-token prompts. A fixed
pure-Python task timed between decisions shows how much of the tail is the machine. Between
decisions (``--churn``, default on) the blocks the chosen instance computes for the
decided prompt (past its own cached prefix: engines report new blocks only) are stored
on it and the index's vectorised mirror synced, as the gateway does on every KV-event
batch; that update is timed and reported apart. ``--groups G`` puts instance *i* (prefill
and decode) in group ``i % G`` (engine revisions during a rollout: each decode choice is
then restricted to the prefill's group); 1, the default, is the usual one-group path.
The Conductor's hot-prefix tracker is the gateway's, which also keeps the token ids of
prefixes about to be hot (``--hot-tokens``, default on; ``--no-hot-tokens``: the core's
plain tracker), inside the timed decision as in the gateway. Pools of ``--min-pool``
instances or more price candidates only (``--no-candidates``: a full pass); between
decisions the chosen prefill instance queues the request and a random one finishes its
head (``--load-churn``, default on; timed apart), so the load orders are updated as in
the gateway. ``--compare`` decides each request again by a full pass over the same
states (untimed) and counts the choices that differ, and those worse beyond the tie
band (docs/results/fleet-decisions.md).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Iterator

import numpy as np
from mooncake_conductor.blockkeys import block_keys, block_keys_array, namespace_seed
from mooncake_conductor.candidates import CandidatesConfig
from mooncake_conductor.engine import Conductor, ConductorConfig
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo
from mooncake_conductor.warmup import warm_up
from mooncake_gateway.hottokens import HotPrefixTokens
from mooncake_gateway.settings import GatewaySettings
from mooncake_gateway.validate import _token_ids

BLOCK = 16
VOCAB = 131072
CHAIN_BLOCKS = 512
SHARE_EVERY = 10
MICRO = 1e6


FIXED_TASK_STEPS = 2000  # ~100 µs of pure-Python arithmetic on this project's machines


def _fixed_task() -> int:
    """The same CPU work every time: its p99/p50 in the run is the machine's own noise."""
    total = 0
    for i in range(FIXED_TASK_STEPS):
        total += i * i
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=10000)
    ap.add_argument("--policy", default="conductor")
    ap.add_argument("--candidates", action=argparse.BooleanOptionalAction, default=True,
                    help="price candidates only on pools of at least --min-pool instances "
                    "(off: one pass over every instance)")
    ap.add_argument("--min-pool", type=int, default=CandidatesConfig().min_pool)
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=False,
                    help="also decide each request by a full pass over the same states "
                    "(untimed) and count the choices that differ beyond the tie band")
    ap.add_argument("--load-churn", action=argparse.BooleanOptionalAction, default=True,
                    help="between decisions the chosen prefill instance queues the request "
                    "and a random one finishes its head (the load order follows)")
    ap.add_argument("--churn", action=argparse.BooleanOptionalAction, default=True,
                    help="store each decided prompt on its instance (KV events) between "
                    "decisions")
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="gc.freeze() once set up, as the gateway does (setting gc_freeze)")
    ap.add_argument("--pending", action=argparse.BooleanOptionalAction, default=True,
                    help="the blocks of every queued prefill are pending on its instance")
    ap.add_argument("--groups", type=int, default=1,
                    help="instance groups (revisions): instance i is in group i %% G")
    ap.add_argument("--hot-tokens", action=argparse.BooleanOptionalAction, default=True,
                    help="the gateway's tracker that keeps hot prefixes' tokens (in the "
                    "timed decision); off: the core's plain tracker")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    prng = random.Random(0)
    seed = namespace_seed("bench", BLOCK)
    n_inst = a.instances
    index = PrefixIndex(max(1, 2 * a.blocks // n_inst), instances=n_inst)
    chains: list[np.ndarray] = []
    t0 = time.perf_counter()
    stored = 0
    while stored < a.blocks:
        toks = rng.integers(256, VOCAB, size=CHAIN_BLOCKS * BLOCK)
        keys = block_keys(toks, BLOCK, seed)
        holders = prng.sample(range(n_inst), 3 if len(chains) % SHARE_EVERY == 0 else 1)
        for h in holders:
            index.store(h, keys)
        chains.append(toks)
        stored += len(keys)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.match_all(keys)  # past VECTOR_MIN_KEYS the first query builds the numpy mirror
    mirror_s = time.perf_counter() - t0
    params = {"cpp": {"enabled": False}, "priority_weight": 0.0} if a.policy == "conductor" \
        else {}
    cand = CandidatesConfig(enabled=a.candidates, min_pool=a.min_pool)
    cond = Conductor(ConductorConfig(policy=a.policy, params=params, candidates=cand))
    full = Conductor(ConductorConfig(policy=a.policy, params=params,
                                     candidates=CandidatesConfig(enabled=False)))
    warm_up()  # as the gateway does before serving (setting warm_kernels)
    cluster = ClusterState(
        prefill=[PrefillState(iid=i) for i in range(n_inst)],
        decode=[DecodeState(iid=i, capacity_tokens=1_000_000) for i in range(a.decode)],
        index=index,
    )
    for st in [*cluster.prefill, *cluster.decode]:
        st.group = st.iid % a.groups
    gw = GatewaySettings()
    keeper = HotPrefixTokens(cond.config.replication, BLOCK, gw.hot_tokens_rate_share,
                             gw.hot_tokens_prefixes, gw.hot_tokens_max)
    if a.hot_tokens:  # the gateway's tracker, which also keeps hot prefixes' tokens
        cond.hot = keeper
    for d in cluster.decode:  # running batches of different sizes
        d.batch = prng.randint(0, 32)
        d.context_tokens = d.batch * prng.randint(500, 4000)
    for p in cluster.prefill:  # some queued work everywhere, its blocks pending
        for j in range(prng.randint(0, 4)):
            p.enqueue(10**9 + j, 0.0, prng.random(), 100, 1600)
            if a.pending:  # as the gateway marks a dispatched prefill's blocks
                base = chains[prng.randrange(len(chains))]
                shared = prng.randrange(0, len(base) + 1)
                toks = np.concatenate([base[:shared],
                                       rng.integers(256, VOCAB, size=a.tokens - shared)])
                index.add_pending(p.iid, block_keys(toks, BLOCK, seed))
    index.sync()

    def prompts() -> Iterator[np.ndarray]:
        """Each prompt is made just before its decision, as a tokenizer hands it over."""
        for _ in range(a.rounds):
            base = chains[prng.randrange(len(chains))]
            shared = min(prng.randrange(0, a.tokens + 1), len(base))
            tail = rng.integers(256, VOCAB, size=a.tokens - shared)
            yield np.concatenate([base[:shared], tail]).astype(np.int64)

    lat_keys: list[float] = []
    lat_all: list[float] = []
    lat_policy: list[float] = []
    lat_validate: list[float] = []
    lat_decode: list[float] = []
    lat_update: list[float] = []
    lat_fixed: list[float] = []
    crossed = 0
    gc_hits: set[int] = set()
    if a.gc_freeze:  # as the gateway does once started (setting gc_freeze)
        gc.collect()
        gc.freeze()
    in_decision = [False]  # a collection starting then lands in the decision's time
    gc_runs = [0]

    def on_gc(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            gc_runs[0] += 1
            if in_decision[0]:
                gc_hits.add(len(lat_all))

    gc.callbacks.append(on_gc)
    now = 1000.0
    lat_load: list[float] = []
    compared = [0, 0, 0, 0]  # decisions, other prefill, beyond the tie band, decode beyond
    ttft_gap: list[float] = []
    tol = cond.policy.params.tie_tolerance if hasattr(cond.policy.params, "tie_tolerance") \
        else 0.0
    for i, toks in enumerate(prompts()):
        if a.compare:  # the full pass on the same states, untimed
            arr = block_keys_array(toks, BLOCK, seed)
            same = RequestInfo(rid=i, arrival=now, input_tokens=len(toks), output_tokens=128,
                               keys=arr.tolist(), block_tokens=BLOCK, key_array=arr)
            ref_pl = full.policy.choose(same, cluster, now)
            ref_dc = full.decode_selector.choose(same, cluster.decode)
        in_decision[0] = True
        t = time.perf_counter()
        key_array = block_keys_array(toks, BLOCK, seed)
        keys = key_array.tolist()
        tk = time.perf_counter()
        req = RequestInfo(rid=i, arrival=now, input_tokens=len(toks), output_tokens=128,
                          keys=keys, block_tokens=BLOCK, key_array=key_array)
        keeper.prompt = toks  # as the gateway hands the prompt to its tracker
        decision = cond.schedule(req, cluster, now)
        keeper.prompt = None
        te = time.perf_counter()
        in_decision[0] = False
        lat_keys.append(tk - t)
        lat_all.append(te - t)
        pl, dc = decision.placement, decision.decode
        if a.compare:
            full.decode_selector.placed(req, dc.decode)
            compared[0] += 1
            compared[1] += ref_pl.prefill != pl.prefill
            compared[2] += pl.ttft_s > ref_pl.ttft_s * (1 + tol) + 0.005
            compared[3] += dc.predicted_tbt_s > ref_dc.predicted_tbt_s * 1.01
            ttft_gap.append(pl.ttft_s - ref_pl.ttft_s)
        if a.load_churn and pl.prefill is not None:
            tl = time.perf_counter()  # the chosen instance queues it, another finishes one
            cluster.prefill[pl.prefill].enqueue(i, 0.0, pl.prefill_s, 0, 0)
            done = cluster.prefill[prng.randrange(n_inst)]
            if done.queue:
                done.busy_until = now + done.pop().work_s
            lat_load.append(time.perf_counter() - tl)
        if pl.prefill is not None and dc.decode is not None and \
                cluster.prefill[pl.prefill].group != cluster.decode[dc.decode].group:
            crossed += 1
        if a.churn and decision.placement.prefill is not None:
            # the chosen instance's KV events arrive: the blocks it computed (past its
            # own cached prefix; an engine reports new blocks only) are stored, the LRU
            # evicts as many old ones, and the mirror is synced, as the gateway does
            # after every event batch; timed apart, off the decision's path
            tu = time.perf_counter()
            index.store(decision.placement.prefill, keys[decision.placement.local_blocks:])
            index.sync()
            lat_update.append(time.perf_counter() - tu)
        tc = time.perf_counter()  # machine-noise yardstick: a fixed pure-Python task
        _fixed_task()
        lat_fixed.append(time.perf_counter() - tc)
        as_list = toks.tolist()  # a token-id prompt as JSON gives it: a list of ints
        tv = time.perf_counter()
        _token_ids(as_list)
        lat_validate.append(time.perf_counter() - tv)
        t1 = time.perf_counter()  # the two halves of schedule(), timed apart (same inputs)
        cond.policy.choose(req, cluster, now)
        t2 = time.perf_counter()
        cond.decode_selector.choose(req, cluster.decode)
        t3 = time.perf_counter()
        lat_policy.append(t2 - t1)
        lat_decode.append(t3 - t2)
        now += 0.001

    def pct(xs: list[float], q: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))] * MICRO

    print(f"index: {len(index):,} distinct blocks, {index.size():,} entries on {n_inst} "
          f"instances (built in {build_s:.1f} s, vectorised mirror in {mirror_s:.1f} s); "
          f"prompts {a.tokens} tokens, block {BLOCK}, policy {a.policy}, {a.rounds} decisions, "
          f"{n_inst} + {a.decode} instances, candidates "
          f"{'from ' + str(a.min_pool) + ' instances' if a.candidates else 'off'}")
    print(f"block keys only   : p50 {pct(lat_keys, 0.5):7.1f} µs  p99 "
          f"{pct(lat_keys, 0.99):7.1f} µs")
    print(f"token-id list → validated int64 array: p50 {pct(lat_validate, 0.5):7.1f} µs  "
          f"p99 {pct(lat_validate, 0.99):7.1f} µs")
    print(f"prefill policy    : p50 {pct(lat_policy, 0.5):7.1f} µs  p99 "
          f"{pct(lat_policy, 0.99):7.1f} µs")
    print(f"decode selector   : p50 {pct(lat_decode, 0.5):7.1f} µs  p99 "
          f"{pct(lat_decode, 0.99):7.1f} µs  ({a.decode} decode instances)")
    if a.hot_tokens:
        print(f"hot-prefix tokens : kept by the tracker in the decision ({keeper.copies} "
              f"prefixes copied, {keeper.kept()} kept)")
    if a.groups > 1:
        print(f"groups            : {a.groups}; decode in another group than the prefill: "
              f"{crossed} of {len(lat_all)}")
    if lat_update:
        print(f"index update      : p50 {pct(lat_update, 0.5):7.1f} µs  p99 "
              f"{pct(lat_update, 0.99):7.1f} µs  (store the new blocks of a decided prompt "
              f"+ LRU evictions + mirror sync; not in the decision)")
    if lat_load:
        print(f"load update       : p50 {pct(lat_load, 0.5):7.1f} µs  p99 "
              f"{pct(lat_load, 0.99):7.1f} µs  (queue on the chosen instance, finish one "
              f"elsewhere; the load order follows; not in the decision)")
    if compared[0]:
        print(f"full pass compared: {compared[0]} decisions; another prefill instance "
              f"{compared[1]} ({100 * compared[1] / compared[0]:.1f} %), TTFT beyond the tie "
              f"band {compared[2]} ({100 * compared[2] / compared[0]:.2f} %, mean gap "
              f"{1000 * statistics.mean(ttft_gap):+.2f} ms); decode step beyond 1 % "
              f"{compared[3]} ({100 * compared[3] / compared[0]:.2f} %)")
    top = sorted(range(len(lat_all)), key=lat_all.__getitem__)[-max(1, len(lat_all) // 100):]
    print(f"garbage collector: ran {gc_runs[0]} times, during {len(gc_hits)} decisions "
          f"({100 * len(gc_hits) / len(lat_all):.2f} %), {len(gc_hits & set(top))} of them "
          f"in the slowest 1 %")
    fixed50, fixed99 = pct(lat_fixed, 0.5), pct(lat_fixed, 0.99)
    print(f"fixed CPU task    : p50 {fixed50:7.1f} µs  p99 {fixed99:7.1f} µs  (the same "
          f"work every time: p99/p50 {fixed99 / fixed50:.2f} is this machine's noise)")
    all50, all99 = pct(lat_all, 0.5), pct(lat_all, 0.99)
    print(f"keys + decision   : p99/p50 {all99 / all50:.2f}")
    print(f"keys + decision   : p50 {pct(lat_all, 0.5):7.1f} µs  p99 {pct(lat_all, 0.99):7.1f} µs"
          f"  mean {statistics.mean(lat_all) * MICRO:7.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
