"""Conditions and their reasons, from hand-made observations."""

from __future__ import annotations

import dataclasses

from mooncake_operator import rollout as ro
from mooncake_operator import status as st
from mooncake_operator.observe import StoreView
from mooncake_operator.spec import MooncakeClusterStatus

from .test_rollout import OLD, pod, reg

READY_STORE = StoreView(enabled=True, master_ready=True, nodes_desired=8, nodes_ready=8)


def compute(pods: list, **kw: object) -> MooncakeClusterStatus:  # type: ignore[type-arg]
    base = dict(generation=3, revision="newrev0000", policy="conductor",
                desired={"prefill": 2, "decode": 2}, pods=pods, registry=reg(pods),
                gateway_gate=True, gateway_endpoint="http://gw:8080", served_model="m",
                store=READY_STORE, store_address="c-store.ns.svc:50051", plan=ro.PoolPlan(),
                invalid=None, hot_prefixes=[], previous=MooncakeClusterStatus(),
                gpu_resource="nvidia.com/gpu", crash_restarts=3, crash_window_s=600.0,
                recent_crashes={}, now=1000.0)
    base.update(kw)
    return st.compute(st.StatusInput(**base))  # type: ignore[arg-type]


def cond(s: MooncakeClusterStatus, ctype: str) -> tuple[str, str]:
    c = next(c for c in s.conditions if c.type == ctype)
    return c.status.value, c.reason


def serving() -> list:  # type: ignore[type-arg]
    return [pod(r, i) for r in ro.ROLES for i in range(2)]


def test_all_ready() -> None:
    s = compute(serving())
    assert cond(s, "Ready") == ("True", "AllReady")
    assert cond(s, "Progressing") == ("False", "Complete")
    assert cond(s, "Degraded") == ("False", "AsExpected")
    assert (s.prefill.summary, s.decode.summary, s.store.state) == ("2/2", "2/2", "Ready")
    assert s.observed_generation == 3 and all(c.observed_generation == 3 for c in s.conditions)


def test_ready_in_kubernetes_is_not_enough() -> None:
    pods = serving()
    s = compute(pods, registry=reg(pods, **{pods[0].name: {"registered": False}}))
    assert cond(s, "Ready") == ("False", "EngineNotReady")
    assert s.prefill.summary == "1/2" and s.prefill.ready == 2


def test_missing_gpu_capacity() -> None:
    msg = "0/9 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, " \
          "8 Insufficient nvidia.com/gpu."
    pods = [*serving()[:3], pod("decode", 1, ready=False, phase="Pending", unschedulable=msg)]
    s = compute(pods)
    assert cond(s, "Degraded") == ("True", "InsufficientGPUCapacity")
    assert cond(s, "Ready") == ("False", "InsufficientGPUCapacity")
    assert cond(s, "Progressing") == ("False", "Stalled")


def test_selector_matching_nothing() -> None:
    msg = "0/9 nodes are available: 9 node(s) didn't match Pod's node affinity/selector."
    pods = [pod("prefill", 0, ready=False, phase="Pending", unschedulable=msg)]
    assert cond(compute(pods), "Degraded") == ("True", "NoMatchingNodes")


def test_crash_loop_and_store() -> None:
    pods = serving()
    pods[1] = dataclasses.replace(pods[1], ready=False, crash_looping=True, restarts=4)
    s = compute(pods, recent_crashes={pods[1].uid: 3})
    assert cond(s, "Ready") == ("False", "EngineCrashLooping")
    degraded = next(c for c in s.conditions if c.type == "Degraded")
    assert "crashed 3 times in the last 10 min (4 restarts in all)" in degraded.message
    # crashes outside the window (or too few) are not crash-looping, whatever the lifetime
    # count: a healed pod clears Degraded
    assert cond(compute(pods, recent_crashes={pods[1].uid: 2}), "Degraded")[0] == "False"
    s = compute(serving(), store=StoreView(enabled=True, master_ready=False))
    assert cond(s, "Ready") == ("False", "StoreNotReady") and s.store.state == "Pending"
    bad = StoreView(enabled=True, master_problem="m-0: crash-looping")
    assert cond(compute(serving(), store=bad), "Degraded") == ("True", "StoreDegraded")


def test_rollout_and_gateway() -> None:
    pods = [*serving(), pod("prefill", 0, OLD)]
    plan = ro.PoolPlan(rollout=ro.RolloutState("newrev0000", 1, 2, {"prefill": 2}, 990.0),
                       activity="RollingUpdate", waiting=["1 new decode pod(s) not registered"])
    s = compute(pods, plan=plan)
    assert cond(s, "Ready") == ("False", "RolloutInProgress")
    assert cond(s, "Progressing") == ("True", "RollingUpdate")
    assert s.rollout is not None and (s.rollout.step, s.rollout.steps) == (1, 2)
    s2 = compute(serving(), registry=None)
    assert cond(s2, "Ready") == ("False", "GatewayUnreachable") and not s2.gateway.reachable


def test_invalid_spec_wins() -> None:
    s = compute(serving(), invalid=st.Problem("InvalidSpec", "spec.conductor.params: x"))
    assert cond(s, "Ready") == ("False", "InvalidSpec")
    assert cond(s, "Degraded") == ("True", "InvalidSpec")


def test_transition_time_kept_and_transitions_listed() -> None:
    first = compute(serving(), now=1000.0)
    again = compute(serving(), previous=first, now=2000.0)
    assert [c.last_transition_time for c in again.conditions] == \
        [c.last_transition_time for c in first.conditions]
    assert st.transitions(first, again) == []
    worse = compute(serving(), previous=first, store=StoreView(enabled=True), now=3000.0)
    changed = st.transitions(first, worse)
    assert [(c.type, c.reason) for c in changed] == [("Ready", "StoreNotReady")]
    ready = next(c for c in worse.conditions if c.type == "Ready")
    assert ready.last_transition_time == "1970-01-01T00:50:00Z"
