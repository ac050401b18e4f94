"""Small hand-made clusters and requests for policy tests."""

from __future__ import annotations

import random

from mooncake_conductor.cost import CostModel
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.policies.base import PolicyContext, PrefillPolicy, SLOConfig
from mooncake_conductor.policies.registry import create_policy
from mooncake_conductor.state import ClusterState, DecodeState, PrefillState, RequestInfo

BT = 512
COST = CostModel()


def cluster(n: int = 4, decode: int = 2, capacity_blocks: int = 10_000) -> ClusterState:
    return ClusterState(
        prefill=[PrefillState(iid=i, name=f"p{i}") for i in range(n)],
        decode=[DecodeState(iid=i, capacity_tokens=COST.kv_capacity_tokens) for i in range(decode)],
        index=PrefixIndex(capacity_blocks, instances=n),
    )


def request(
    keys: list[int],
    tokens: int | None = None,
    arrival: float = 0.0,
    output: int = 100,
    rid: int = 0,
) -> RequestInfo:
    return RequestInfo(
        rid=rid,
        arrival=arrival,
        input_tokens=tokens or len(keys) * BT,
        output_tokens=output,
        keys=keys,
        block_tokens=BT,
    )


def queue(inst: PrefillState, seconds: float, rid: int = 999, requests: int = 1) -> None:
    for i in range(requests):
        inst.enqueue(rid + i, 0.0, seconds / requests, 4, 4 * BT)


def policy(
    name: str, seed: int = 0, slo: SLOConfig | None = None, **params: object
) -> PrefillPolicy:
    ctx = PolicyContext(cost=COST, slo=slo or SLOConfig(), rng=random.Random(seed))
    return create_policy(name, ctx, dict(params))
