"""Interleaved A/B of one decision: variants of ``Conductor.schedule`` on the same prompt,
one after another, so a shared, noisy host slows them alike.

    python benchmarks/gateway_decision_ab.py [--rounds 6000] [--groups 1] [--blocks 1000000]

The setting is ``gateway_decision.py``'s (8k-token prompts, 64 + 64 instances, 1M indexed
blocks, queued prefills pending, decode batches of 0-32; no churn). Variants, each with
its own Conductor (same policy and seed) on the one cluster, in rotating order:

- ``before-groups``: the body of ``Conductor.schedule`` before instance groups (commit
  863ef5f): policy, decode selector, admission, ``on_placed``, hot-prefix record;
- ``schedule``: ``Conductor.schedule`` now (with ``--groups 1`` its one-group fast path;
  with ``--groups G`` > 1 the grouped path: decode within the prefill's group);
- ``schedule+tokens``: the same with the gateway's tracker, which also keeps the token
  ids of prefixes about to be hot (``mooncake_gateway.hottokens``), the prompt handed
  over as the gateway does.

Timed: the ``schedule`` call alone (block keys are made once per prompt, untimed).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Callable

import numpy as np
from mooncake_conductor.blockkeys import block_keys, block_keys_array, namespace_seed
from mooncake_conductor.engine import Conductor, ConductorConfig, Decision
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo
from mooncake_conductor.warmup import warm_up
from mooncake_gateway.hottokens import HotPrefixTokens
from mooncake_gateway.settings import GatewaySettings

BLOCK = 16
TOKENS = 8192
VOCAB = 131072
CHAIN_BLOCKS = 512
SHARE_EVERY = 10
MICRO = 1e6


def schedule_before_groups(c: Conductor, req: RequestInfo, cluster: ClusterState,
                           now: float) -> Decision:
    """``Conductor.schedule`` as it was before instance groups (863ef5f)."""
    placement = c.policy.choose(req, cluster, now)
    decode = c.decode_selector.choose(req, cluster.decode)
    if c.capabilities.admission:
        if placement.reject_reason is None and placement.ttft_s > c.config.slo.ttft_s:
            placement.reject_reason = "ttft-slo"
    elif decode.reject_reason == "tbt-slo":
        decode.reject_reason = None
    decision = Decision(placement, decode)
    if not decision.rejected:
        c.policy.on_placed(req, placement, cluster)
        c.hot.record(req.keys, now, placement.reused_blocks, req.key_array)
    return decision


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6000)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    prng = random.Random(0)
    seed = namespace_seed("bench", BLOCK)
    n_inst = 64
    index = PrefixIndex(max(1, 2 * a.blocks // n_inst), instances=n_inst)
    chains: list[np.ndarray] = []
    stored = 0
    while stored < a.blocks:
        toks = rng.integers(256, VOCAB, size=CHAIN_BLOCKS * BLOCK)
        keys = block_keys(toks, BLOCK, seed)
        for h in prng.sample(range(n_inst), 3 if len(chains) % SHARE_EVERY == 0 else 1):
            index.store(h, keys)
        chains.append(toks)
        stored += len(keys)
    index.match_all(keys)
    params = {"cpp": {"enabled": False}, "priority_weight": 0.0}
    before, now_c, tok_c = (Conductor(ConductorConfig(policy="conductor", params=params))
                            for _ in range(3))
    gw = GatewaySettings()
    keeper = HotPrefixTokens(tok_c.config.replication, BLOCK, gw.hot_tokens_rate_share,
                             gw.hot_tokens_prefixes, gw.hot_tokens_max)
    tok_c.hot = keeper
    warm_up()
    cluster = ClusterState(
        prefill=[PrefillState(iid=i) for i in range(n_inst)],
        decode=[DecodeState(iid=i, capacity_tokens=1_000_000) for i in range(n_inst)],
        index=index)
    for st in [*cluster.prefill, *cluster.decode]:
        st.group = st.iid % a.groups
    for d in cluster.decode:
        d.batch = prng.randint(0, 32)
        d.context_tokens = d.batch * prng.randint(500, 4000)
    for p in cluster.prefill:
        for j in range(prng.randint(0, 4)):
            p.enqueue(10**9 + j, 0.0, prng.random(), 100, 1600)
            base = chains[prng.randrange(len(chains))]
            shared = prng.randrange(0, len(base) + 1)
            toks = np.concatenate([base[:shared], rng.integers(256, VOCAB, size=TOKENS - shared)])
            index.add_pending(p.iid, block_keys(toks, BLOCK, seed))
    index.sync()
    prompt: list[np.ndarray] = []

    def with_tokens(req: RequestInfo, now: float) -> Decision:
        keeper.prompt = prompt[0]
        try:
            return tok_c.schedule(req, cluster, now)
        finally:
            keeper.prompt = None

    variants: dict[str, Callable[[RequestInfo, float], Decision]] = {
        "before-groups": lambda req, now: schedule_before_groups(before, req, cluster, now),
        "schedule": lambda req, now: now_c.schedule(req, cluster, now),
        "schedule+tokens": with_tokens,
    }
    names = list(variants)
    lat: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    gc.freeze()
    now = 1000.0
    for i in range(a.rounds):
        base = chains[prng.randrange(len(chains))]
        shared = min(prng.randrange(0, TOKENS + 1), len(base))
        toks = np.concatenate([base[:shared], rng.integers(256, VOCAB, size=TOKENS - shared)])
        prompt[:] = [toks.astype(np.int64)]
        key_array = block_keys_array(prompt[0], BLOCK, seed)
        keys = key_array.tolist()
        k = i % len(names)
        for name in names[k:] + names[:k]:
            req = RequestInfo(rid=i, arrival=now, input_tokens=TOKENS, output_tokens=128,
                              keys=keys, block_tokens=BLOCK, key_array=key_array)
            t = time.perf_counter()
            variants[name](req, now)
            lat[name].append(time.perf_counter() - t)
        now += 0.001
    print(f"{a.rounds} prompts of {TOKENS} tokens, {len(index):,} indexed blocks, "
          f"{n_inst} + {n_inst} instances in {a.groups} group(s); schedule() only")
    for name in names:
        xs = sorted(lat[name])
        n = len(xs)
        print(f"{name:16s} p50 {xs[n // 2] * MICRO:7.1f} µs  p90 {xs[int(0.9 * n)] * MICRO:7.1f}"
              f"  p99 {xs[int(0.99 * n)] * MICRO:7.1f}  mean {sum(xs) / n * MICRO:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
