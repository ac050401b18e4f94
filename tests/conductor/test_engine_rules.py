"""The Conductor's own duties, one by one: it builds its cost model and policy from the
config, calibrates the prefill scale from the first observation on, tells the policy
of every placed, prefilled and finished request (never of a rejected one), records
hot prefixes, and keeps pipeline groups within one engine group."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from mooncake_conductor.cost import CostModelConfig, HardwareSpec
from mooncake_conductor.engine import Conductor, ConductorConfig, Decision
from mooncake_conductor.state import ClusterState

from .helpers import cluster, queue, request


def test_the_cost_model_and_policy_params_come_from_the_config() -> None:
    cost = CostModelConfig(hardware=HardwareSpec(gpus=4))
    cfg = ConductorConfig(policy="conductor", cost=cost,
                          params={"cpp": {"enabled": False}, "priority_weight": 0.5})
    c = Conductor(cfg)
    assert c.cost.config == cost
    assert c.cost.config.hardware.peak_flops == 4 * 312e12
    assert c.policy.params.cpp.enabled is False  # type: ignore[attr-defined]
    assert c.policy.params.priority_weight == 0.5  # type: ignore[attr-defined]


def test_the_first_observation_moves_the_scale_from_one() -> None:
    # log scale starts at 0 (scale 1): one observation twice as slow, rate 0.05,
    # gives exp(0.05 * ln 2) = 2 ** 0.05
    c = Conductor(ConductorConfig(policy="conductor"))
    c.observe_prefill(1.0, 2.0)
    assert c.cost.prefill_scale == pytest.approx(2 ** 0.05, rel=1e-12)


def test_sub_second_prefills_calibrate_too() -> None:
    c = Conductor(ConductorConfig(policy="conductor"))
    c.observe_prefill(0.25, 0.5)
    assert c.cost.prefill_scale == pytest.approx(2 ** 0.05, rel=1e-12)
    c.observe_prefill(0.5, 0.25)  # back by the same log step
    assert c.cost.prefill_scale == pytest.approx(1.0, rel=1e-12)
    assert math.isclose(c.prefill_scale.log, 0.0, abs_tol=1e-15)


def _rejected(d: Decision) -> Decision:
    return Decision(dataclasses.replace(d.placement, reject_reason="ttft-slo"), d.decode)


def test_the_policy_hears_of_placed_prefilled_and_finished_requests() -> None:
    """dynamo-kv keeps books of uncached blocks per instance: a placed request enters
    them, and leaves once prefilled (or finished, when it failed before that)."""
    c = Conductor(ConductorConfig(policy="dynamo-kv"))
    cl = cluster(2)
    r1, r2 = request(list(range(8)), rid=1), request(list(range(20, 25)), rid=2)
    d1, d2 = c.schedule(r1, cl, 0.0), c.schedule(r2, cl, 0.0)
    assert not d1.rejected and not d2.rejected
    books = c.policy._books  # type: ignore[attr-defined]
    assert books[d1.placement.prefill].requests[1] == 8
    assert books[d2.placement.prefill].requests[2] == 5
    c.prefilled(r1, _rejected(d1))  # a rejected request was never in the books
    assert 1 in books[d1.placement.prefill].requests
    c.prefilled(r1, d1)
    assert 1 not in books[d1.placement.prefill].requests
    c.finished(r2, _rejected(d2))
    assert 2 in books[d2.placement.prefill].requests
    c.finished(r2, d2)
    assert 2 not in books[d2.placement.prefill].requests
    assert all(b.uncached == 0 for b in books.values())


def test_finished_requests_release_the_policy_load_count() -> None:
    c = Conductor(ConductorConfig(policy="sglang-cache-aware"))
    r = request(list(range(8)), rid=1)
    d = c.schedule(r, cluster(2), 0.0)
    iid = d.placement.prefill
    load = c.policy._load  # type: ignore[attr-defined]
    assert load[iid] == 1
    c.finished(r, _rejected(d))
    assert load[iid] == 1
    c.finished(r, d)
    assert load[iid] == 0


def test_a_router_prefix_table_learns_where_requests_went() -> None:
    """aibrix-prefix-cache keeps its own prefix table, sized by the cluster: a repeat of
    a placed prompt goes where the first one went, with nothing in the real index."""
    c = Conductor(ConductorConfig(policy="aibrix-prefix-cache", seed=5))
    cl = cluster(4)
    keys = list(range(30))
    first = c.schedule(request(keys, rid=1), cl, 0.0).placement.prefill
    for rid in range(2, 6):
        assert c.schedule(request(keys, rid=rid), cl, 0.0).placement.prefill == first


def test_scheduled_prefixes_are_tracked_from_the_key_array() -> None:
    c = Conductor(ConductorConfig(policy="conductor",
                                  replication={"min_rate_per_s": 1e-9}))
    keys = list(range(40, 50))
    req = request(keys, rid=1)
    req.key_array = np.array(keys, dtype=np.uint64)
    cl = cluster(2)
    for iid in (0, 1):
        cl.index.store(iid, keys[:6])  # the tracker counts the blocks the cluster holds
    c.schedule(req, cl, 0.0)
    req.key_array[:] = 0  # the tracker kept its own copy
    [(prefix, _rate, got)] = c.hot.hot(0.0)
    assert (prefix, got) == (45, tuple(keys[:6]))
    assert isinstance(c.hot._tracked[45].keys, np.ndarray)


# -- engine groups -----------------------------------------------------------------------

CPP = {"cpp": {"enabled": True, "min_new_tokens": 1, "reserve_idle_share": 0.0,
               "max_group": 4}}
LONG = list(range(200))


def _grouped(groups: list[int], decode_groups: list[int]) -> ClusterState:
    c = cluster(len(groups), decode=len(decode_groups))
    for st, g in zip(c.prefill, groups, strict=True):
        st.group = g
    for dst, g in zip(c.decode, decode_groups, strict=True):
        dst.group = g
    return c


def test_a_two_instance_pipeline_across_groups_is_chosen_again() -> None:
    c = cluster(2, decode=2)
    d = Conductor(ConductorConfig(policy="conductor", params=CPP)).schedule(
        request(LONG, tokens=200 * 512), c, 0.0)
    assert len(d.placement.cpp_group) == 2  # as one group: both instances
    c = _grouped([1, 2], [1, 2])
    d = Conductor(ConductorConfig(policy="conductor", params=CPP)).schedule(
        request(LONG, tokens=200 * 512), c, 0.0)
    assert len(d.placement.cpp_group) <= 1  # a group of one engine group's instances


def test_the_pipeline_is_chosen_again_within_the_leaders_group() -> None:
    # instance 0 holds the prompt's first 50 blocks: it leads; group 0 is {0, 2}
    c = _grouped([0, 1, 0, 1], [0, 1])
    c.index.store(0, LONG[:50])
    d = Conductor(ConductorConfig(policy="conductor", params=CPP)).schedule(
        request(LONG, tokens=200 * 512), c, 0.0)
    assert d.placement.prefill == 0
    assert sorted(d.placement.cpp_group) == [0, 2]
    assert d.decode.decode == 0


def test_a_pipeline_within_one_group_is_the_policys_first_choice() -> None:
    """A pipeline inside one engine group is kept as the policy chose it: the policy is
    asked once, draw for draw as when called directly."""
    cfg = ConductorConfig(policy="conductor", params={"cpp": {**CPP["cpp"], "max_group": 2}},
                          seed=11)
    got, ref = Conductor(cfg), Conductor(cfg)
    for t in range(6):
        # group 0: four idle instances (random among equals); group 1: a busy one
        c_got, c_ref = (_grouped([0, 0, 0, 0, 1], [0, 1]) for _ in range(2))
        for c in (c_got, c_ref):
            queue(c.prefill[4], 50.0)
        d = got.schedule(request(LONG, tokens=200 * 512, rid=t), c_got, 0.0)
        want = ref.policy.choose(request(LONG, tokens=200 * 512, rid=t), c_ref, 0.0)
        assert len(d.placement.cpp_group) == 2
        assert d.placement.cpp_group == want.cpp_group
