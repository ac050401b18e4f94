"""The Conductor controller's pure round: which pods get which hot prefixes, annotation
content, rate limit and byte budget."""

from __future__ import annotations

from mooncake_contract.annotations import ReplicaSpec, format_replicas, parse_replicas
from mooncake_operator import hotprefix as hpx
from mooncake_operator.observe import GatewayPod, PodView, Registry
from mooncake_operator.spec import HotPrefixSpec

from .test_rollout import pod

HP = HotPrefixSpec(max_patches_per_interval=4, load_floor_seconds=0.5, load_ratio=1.5)


def registry(loads: dict[str, float]) -> Registry:
    return Registry(model="m", pods={
        n: GatewayPod(pod=f"ns/{n}", role="prefill", registered=True, routable=True,
                      listed=True, predicted_wait_s=w) for n, w in loads.items()})


def hot(prefix: str, holders: list[str], rate: float = 1.0, tokens: int = 64) -> hpx.HotEntry:
    return hpx.HotEntry(prefix=prefix, rate_per_s=rate, blocks=tokens // 16,
                        holders=frozenset(holders), tokens=list(range(tokens)),
                        keys=[1, 2, 3, 4])


def prefill(n: int, **ann: str) -> list[PodView]:
    return [pod("prefill", i, replicas_annotation=ann.get(f"p{i}")) for i in range(n)]


def test_hot_spot_replicated_on_least_loaded_other_pod() -> None:
    pods = prefill(3)
    names = [p.name for p in pods]
    reg = registry({names[0]: 8.0, names[1]: 0.5, names[2]: 0.1})
    plan = hpx.plan(pods, reg, [hot("aa", [names[0]])], HP, store=False)
    assert list(plan.patches) == [names[2]]
    (spec,) = parse_replicas(plan.patches[names[2]])
    assert spec.prefix == "aa" and spec.tokens == list(range(64)) and spec.keys is None
    assert plan.added == [("aa", names[2])]
    assert plan.status[0].pods == [names[2]]


def test_no_hot_spot_no_patch_and_cold_prefix_released() -> None:
    value = format_replicas([ReplicaSpec("aa", tokens=[1])])
    pods = prefill(2, p1=value)
    names = [p.name for p in pods]
    reg = registry({names[0]: 0.2, names[1]: 0.2})
    # still hot: kept, nothing to write
    keep = hpx.plan(pods, reg, [hot("aa", [names[0], names[1]])], HP, store=False)
    assert keep.patches == {} and keep.status[0].pods == [names[1]]
    # gone cold: removed
    cold = hpx.plan(pods, reg, [], HP, store=False)
    assert cold.patches == {names[1]: "[]"} and cold.removed == [("aa", names[1])]


def test_rate_limit_defers_the_rest() -> None:
    pods = prefill(6)
    names = [p.name for p in pods]
    loads = {n: 0.0 for n in names}
    loads[names[0]] = 50.0
    hps = [hot(f"p{i}", [names[0]], rate=10 - i) for i in range(5)]
    limited = HP.model_copy(update={"max_patches_per_interval": 2})
    plan = hpx.plan(pods, registry(loads), hps, limited, store=False)
    assert len(plan.patches) == 2 and plan.deferred == 0  # max_actions caps new copies too
    assert {p for p, _ in plan.added} == {"p0", "p1"}  # hottest first


def test_store_adds_keys_and_budget_drops_what_does_not_fit() -> None:
    entries = {"a": hot("a", [], rate=3.0, tokens=64), "b": hot("b", [], rate=2.0, tokens=4096)}
    value = hpx.annotation_value(["a", "b"], entries, store=True, budget=400)
    specs = parse_replicas(value)
    assert [s.prefix for s in specs] == ["a"] and specs[0].keys == [1, 2, 3, 4]
    bare = {"c": hpx.HotEntry("c", 1.0, 4, frozenset(), tokens=None, keys=[9])}
    assert hpx.annotation_value(["c"], bare, store=False, budget=10_000) == "[]"
    assert parse_replicas(hpx.annotation_value(["c"], bare, store=True, budget=10_000))[0].keys \
        == [9]


def test_parse_hot_accepts_gateway_shapes() -> None:
    data = {"hot_prefixes": [{"prefix": "00ab", "rate_per_s": 2.5, "blocks": 4,
                              "tokens": 64, "token_ids": [1, 2], "holders": ["ns/p-0"],
                              "keys": ["000000000000000a"]}]}
    (h,) = hpx.parse_hot(data)
    assert (h.prefix, h.holders, h.tokens, h.keys) == ("00ab", frozenset({"p-0"}), [1, 2], [10])
    assert hpx.parse_hot(None) == []


def test_a_pod_briefly_unroutable_keeps_its_replicas() -> None:
    value = format_replicas([ReplicaSpec("aa", tokens=[1])])
    pods = prefill(2, p1=value)
    names = [p.name for p in pods]
    reg = registry({names[0]: 0.2})  # the gateway does not list pod 1 right now
    plan = hpx.plan(pods, reg, [hot("aa", [names[0]])], HP, store=False)
    assert plan.patches == {} and plan.status[0].pods == [names[1]]
