"""The pool planner on hand-made cases, and a whole rollout simulated step by step."""

from __future__ import annotations

import dataclasses

from mooncake_operator import rollout as ro
from mooncake_operator.observe import GatewayPod, PodView, Registry

REV, OLD = "newrev0000", "oldrev0000"


def pod(role: str, i: int, rev: str = REV, **kw: object) -> PodView:
    base = dict(name=f"c-{role}-{rev}-{i}", uid=f"u-{role}-{rev}-{i}", role=role, revision=rev,
                ordinal=i, phase="Running", ready=True)
    base.update(kw)
    return PodView(**base)  # type: ignore[arg-type]


def reg(pods: list[PodView], **per_pod: dict[str, object]) -> Registry:
    out = {}
    for p in pods:
        fields: dict[str, object] = dict(registered=p.ready, routable=p.ready and not p.draining,
                                         listed=True)
        fields.update(per_pod.get(p.name, {}))
        out[p.name] = GatewayPod(pod=f"ns/{p.name}", role=p.role, **fields)  # type: ignore[arg-type]
    return Registry(model="m", pods=out)


def inp(pods: list[PodView], registry: Registry | None = None, desired: tuple[int, int] = (2, 2),
        **kw: object) -> ro.PoolInput:
    base = dict(revision=REV, desired={"prefill": desired[0], "decode": desired[1]},
                max_surge=1, drain_timeout_s=60.0, pods=pods,
                registry=registry if registry is not None else reg(pods), gateway_gate=True,
                start_allowed=True, rollout=None, now=1000.0)
    base.update(kw)
    return ro.PoolInput(**base)  # type: ignore[arg-type]


def test_fresh_cluster_creates_everything_with_lowest_ordinals() -> None:
    plan = ro.plan(inp([]))
    assert sorted(plan.create) == [("decode", 0), ("decode", 1), ("prefill", 0), ("prefill", 1)]
    assert plan.activity == "Creating" and plan.rollout is None


def test_nothing_is_created_before_the_store() -> None:
    plan = ro.plan(inp([], start_allowed=False))
    assert plan.create == [] and plan.waiting


def test_steady_state_plans_nothing() -> None:
    pods = [pod(r, i) for r in ro.ROLES for i in range(2)]
    plan = ro.plan(inp(pods))
    assert not plan.writes and plan.activity is None and plan.rollout is None


def test_scale_up_fills_gaps_first() -> None:
    pods = [pod("prefill", 0), pod("prefill", 2), pod("decode", 0), pod("decode", 1)]
    plan = ro.plan(inp(pods, desired=(4, 2)))
    assert plan.create == [("prefill", 1), ("prefill", 3)]
    assert plan.activity == "ScalingUp"


def test_scale_down_is_cache_aware_and_drains() -> None:
    pods = [pod("prefill", i) for i in range(4)] + [pod("decode", i) for i in range(2)]
    registry = reg(pods, **{
        pods[0].name: {"unique_blocks": 900, "index_blocks": 1000},
        pods[1].name: {"unique_blocks": 10, "index_blocks": 5000},   # mostly replicated
        pods[2].name: {"unique_blocks": 500, "index_blocks": 600},
        pods[3].name: {"unique_blocks": 10, "index_blocks": 20},
    })
    plan = ro.plan(inp(pods, registry, desired=(2, 2)))
    assert {p.name for p in plan.drain} == {pods[3].name, pods[1].name}
    assert plan.delete == [] and plan.activity == "ScalingDown"


def test_a_pod_that_serves_nothing_goes_first_and_at_once() -> None:
    pods = [pod("prefill", 0), pod("prefill", 1, ready=False), pod("prefill", 2),
            pod("decode", 0), pod("decode", 1)]
    plan = ro.plan(inp(pods, desired=(2, 2)))
    assert [p.name for p in plan.delete] == [pods[1].name] and plan.drain == []


def test_drained_pod_is_deleted_only_when_idle_or_timed_out() -> None:
    d = pod("prefill", 2, draining=True, drain_since=990.0)
    pods = [pod("prefill", 0), pod("prefill", 1), d, pod("decode", 0), pod("decode", 1)]
    busy = reg(pods, **{d.name: {"routable": False, "inflight": 3}})
    assert ro.plan(inp(pods, busy)).delete == []
    idle = reg(pods, **{d.name: {"routable": False, "inflight": 0}})
    assert ro.plan(inp(pods, idle)).delete == [d]
    still_routed = reg(pods, **{d.name: {"routable": True, "inflight": 0}})
    assert ro.plan(inp(pods, still_routed)).delete == []  # the gateway has not seen it yet
    assert ro.plan(inp(pods, busy, now=990.0 + 60.0)).delete == [d]  # drain timeout


def test_gateway_unknown_never_cuts_a_serving_pod() -> None:
    d = pod("prefill", 2, draining=True, drain_since=995.0)
    pods = [pod("prefill", 0), pod("prefill", 1), d, pod("decode", 0), pod("decode", 1)]
    plan = ro.plan(dataclasses.replace(inp(pods), registry=None))
    assert plan.delete == []


def test_finished_pods_are_replaced() -> None:
    done = pod("decode", 1, phase="Failed", ready=False)
    pods = [pod("prefill", 0), pod("prefill", 1), pod("decode", 0), done]
    plan = ro.plan(inp(pods))
    assert plan.delete == [done]
    # its ordinal is still taken while it exists
    assert plan.create == [("decode", 2)]


def test_rollout_waits_for_registration_not_readiness() -> None:
    old = [pod(r, i, OLD) for r in ro.ROLES for i in range(2)]
    plan = ro.plan(inp(old))
    assert plan.activity == "RollingUpdate" and plan.rollout is not None
    assert (plan.rollout.step, plan.rollout.steps) == (1, 2)
    assert sorted(plan.create) == [("decode", 0), ("prefill", 0)]
    new = [pod("prefill", 0), pod("decode", 0)]
    # Ready in Kubernetes but the gateway has not registered them yet: no old pod leaves
    registry = reg(old + new, **{p.name: {"registered": False, "routable": False} for p in new})
    plan2 = ro.plan(inp(old + new, registry, rollout=plan.rollout))
    assert plan2.drain == [] and plan2.delete == [] and plan2.waiting
    plan3 = ro.plan(inp(old + new, rollout=plan.rollout))
    assert {p.role for p in plan3.drain} == {"prefill", "decode"} and len(plan3.drain) == 2


def _simulate(o: tuple[int, int], t: tuple[int, int], surge: int | str) -> list[dict[str, int]]:
    """Run the planner against a world where new pods register one tick after creation and
    drained pods finish one tick after draining; returns per-tick counts."""
    world: dict[str, PodView] = {}
    for role, n in zip(ro.ROLES, o, strict=True):
        for i in range(n):
            p = pod(role, i, OLD)
            world[p.name] = p
    state: ro.RolloutState | None = None
    history = []
    for tick in range(200):
        pods = list(world.values())
        plan = ro.plan(inp(pods, desired=t, max_surge=surge, rollout=state, now=1000.0 + tick))
        state = plan.rollout
        for role, i in plan.create:
            p = pod(role, i, ready=False)
            world[p.name] = p
        for p in plan.drain:
            world[p.name] = dataclasses.replace(p, draining=True, drain_since=1000.0 + tick)
        for p in plan.delete:
            world.pop(p.name, None)
        for name, p in list(world.items()):  # a tick later: created pods are up
            if not p.ready and not p.draining and p.revision == REV and name not in {
                    n for n in (pod(r, i).name for r, i in plan.create)}:
                world[name] = dataclasses.replace(p, ready=True)
        counts = {}
        for role in ro.ROLES:
            mine = [p for p in world.values() if p.role == role]
            counts[f"{role}_serving"] = sum(1 for p in mine if p.ready and not p.draining)
            counts[f"{role}_total"] = len(mine)
            counts[f"{role}_new"] = sum(1 for p in mine if p.revision == REV)
        history.append(counts)
        if all(p.revision == REV and p.ready for p in world.values()) and \
                [c["prefill_total"] for c in history[-1:]] == [t[0]] and \
                history[-1]["decode_total"] == t[1] and state is None:
            break
    return history


def test_simulated_rollout_keeps_capacity_and_moves_pools_in_step() -> None:
    for o, t, surge in [((2, 2), (2, 2), 1), ((4, 2), (4, 2), "25%"), ((3, 6), (3, 6), 2),
                        ((2, 2), (4, 2), 1), ((4, 4), (2, 2), 1)]:
        history = _simulate(o, t, surge)
        last = history[-1]
        assert last["prefill_total"] == last["prefill_new"] == t[0], (o, t, history[-3:])
        assert last["decode_total"] == last["decode_new"] == t[1], (o, t)
        for h in history:
            for role, want, had in zip(ro.ROLES, t, o, strict=True):
                # availability: never below what was serving and wanted
                assert h[f"{role}_serving"] >= min(want, had) - 0, (o, t, h)
                # surge bounded by the batch per step
                batch = ro.surge_count(surge, max(want, had))
                assert h[f"{role}_total"] <= max(want, had) + batch, (o, t, h)
        # both pools progress together: new fractions never drift more than one step apart
        for h in history:
            fp, fd = h["prefill_new"] / t[0], h["decode_new"] / t[1]
            assert abs(fp - fd) <= 0.51, (o, t, h)


def test_surge_count() -> None:
    assert ro.surge_count("25%", 8) == 2 and ro.surge_count("25%", 3) == 1
    assert ro.surge_count(0, 5) == 1 and ro.surge_count(3, 5) == 3
