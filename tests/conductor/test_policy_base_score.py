"""The policy registry (kept by ``policies.base``, looked up through ``policies.registry``)
and shared helpers (``policies.base``), and the ``score`` policy's rule, on hand-made cases
whose outcome is worked out from the docstrings."""

import ast
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mooncake_conductor import index as index_module
from mooncake_conductor import policies as policies_package
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.policies import base
from mooncake_conductor.policies.base import (
    Placement,
    PrefillPolicy,
    least,
    register,
    router_mask,
)
from mooncake_conductor.policies.registry import policy_class, policy_names
from mooncake_conductor.state import ClusterState, PrefillState, RequestInfo

from .helpers import BT, COST, cluster, policy, queue, request

KEYS = list(range(20))  # 10240 tokens
N = 20 * BT


# -- registry ------------------------------------------------------------------------------
class _Dummy(PrefillPolicy):
    Params = base.SLOConfig

    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        return Placement(prefill=live[0].iid)


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """The registry as it is now, restored in place afterwards (``.registry`` reads the
    very dict ``base`` keeps, so it is not swapped for a copy)."""
    saved = dict(base._REGISTRY)
    yield
    base._REGISTRY.clear()
    base._REGISTRY.update(saved)


@pytest.mark.usefixtures("scratch_registry")
def test_register_adds_a_named_class_and_refuses_a_nameless_or_second_one() -> None:
    named = type("Named", (_Dummy,), {"name": "test-named"})
    assert register(named) is named
    assert policy_class("test-named") is named
    assert "test-named" in policy_names()
    with pytest.raises(ValueError, match="Nameless has no name"):
        register(type("Nameless", (_Dummy,), {}))
    with pytest.raises(ValueError, match="policy 'test-named' registered twice"):
        register(type("Again", (_Dummy,), {"name": "test-named"}))
    assert policy_class("test-named") is named  # the first one stays


def test_unknown_policy_error_lists_the_known_names() -> None:
    with pytest.raises(KeyError) as err:
        policy_class("no-such-policy")
    msg = str(err.value)
    assert "unknown policy 'no-such-policy'" in msg
    assert "conductor, dynamo-kv" in msg  # sorted, comma separated


#: modules of the policies package that define no policy
NOT_POLICIES = {"__init__", "base", "_all", "registry", "conductor_options"}


def test_all_imports_every_policy_module_and_each_registers_a_policy() -> None:
    folder = Path(policies_package.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - NOT_POLICIES
    assert len(modules) >= 10
    tree = ast.parse((folder / "_all.py").read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module
                for alias in node.names}
    assert imported == modules  # a policy module _all forgets is never registered
    registered_by = {policy_class(n).__module__ for n in policy_names()}
    for module in sorted(modules):
        assert f"{policies_package.__name__}.{module}" in registered_by, (
            f"policies/{module}.py registers no policy (a helper: add it to NOT_POLICIES)")


# -- helpers -------------------------------------------------------------------------------
def test_router_mask_sets_each_bit_and_adds_unseen_instances() -> None:
    index = PrefixIndex(100, instances=0)
    index.add_instance(1)
    assert router_mask(index, [1]) == 0b10
    assert index.live_mask == 0b10
    # id 0 is unseen although id 1 (the next bit) is: it is added; 3 too
    assert router_mask(index, [0, 3]) == 0b1001
    assert index.live_mask == 0b1011
    assert router_mask(index, []) == 0


def test_router_mask_leaves_known_instances_and_their_blocks_alone() -> None:
    index = PrefixIndex(100, instances=0)
    index.add_instance(2, capacity_blocks=5)
    index.store(2, [7, 8])
    assert router_mask(index, [2]) == 0b100
    assert index.match(2, [7, 8]) == 2 and index.capacity(2) == 5


def test_least_counts_a_value_at_the_tolerance_edge_as_a_tie() -> None:
    # best 0: the band is [0, 0 + 0 * rel_tol + 1e-12], edge included
    rng = random.Random(3)
    assert {least([(0.0, 0), (1e-12, 1)], rng) for _ in range(40)} == {0, 1}
    assert {least([(0.0, 0), (2e-12, 1)], rng) for _ in range(40)} == {0}


def test_least_with_one_best_draws_nothing_from_the_rng() -> None:
    """A clear winner leaves the shared generator alone, so a seeded run's later random
    choices do not depend on how many clear decisions came before."""
    rng = random.Random(5)
    state = rng.getstate()
    assert least([(2.0, 4), (1.0, 9), (3.0, 1)], rng) == 9
    assert rng.getstate() == state


# -- score -------------------------------------------------------------------------------
def test_score_cached_share_is_a_fraction_of_the_prompt() -> None:
    """alpha 0.7, beta 0.3, overload 10 s. Instance 0 holds 4 of 20 blocks (share 0.2)
    and waits 5 s (load 0.5): 0.14 + 0.15 = 0.29; idle instance 1 holds nothing: 0.3."""
    c = cluster(2)
    c.index.store(0, KEYS[:4])
    queue(c.prefill[0], 5.0)
    pl = policy("score").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.queue_s) == (1, 0, 0.0)
    assert pl.prefill_s == COST.prefill_time(N, 0)


def test_score_load_is_the_wait_over_overload_s() -> None:
    """As above with a 4 s wait (load 0.4): instance 0 scores 0.14 + 0.18 = 0.32 against
    0.3 and is chosen, reusing its 4 blocks."""
    c = cluster(2)
    c.index.store(0, KEYS[:4])
    queue(c.prefill[0], 4.0)
    pl = policy("score").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks, pl.queue_s) == (0, 4, 4.0)
    assert pl.prefill_s == COST.prefill_time(N, 4 * BT)


def test_score_one_token_prompt_share_is_whole() -> None:
    """A 1-token prompt held by instance 0 (share 1.0, 2 s wait, load 0.2) with alpha
    0.2, beta 0.8: 0.2 + 0.64 = 0.84 against the idle instance's 0.8."""
    c = cluster(2)
    c.index.store(0, [0])
    queue(c.prefill[0], 2.0)
    pl = policy("score", alpha=0.2, beta=0.8).choose(request([0], tokens=1), c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (0, 1)


def test_score_overload_path_breaks_ties_at_random() -> None:
    c = cluster(2)
    queue(c.prefill[0], 12.0)
    queue(c.prefill[1], 12.0)
    picks = {policy("score", seed=s).choose(request(KEYS), c, 0.0).prefill for s in range(12)}
    assert picks == {0, 1}


# -- the request's key array -------------------------------------------------------------
def _no_conversion(keys: Any) -> Any:
    raise AssertionError("the request's key array was not used")


@pytest.mark.parametrize("name", ["score", "conductor"])
def test_large_index_matching_uses_the_requests_key_array(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RequestInfo.key_array`` spares the large-index path a conversion per decision:
    the policy hands it to the index, which then never converts ``keys``."""
    c = cluster(2)
    c.index.vector_min_keys = 1
    c.index.store(0, KEYS[:6])
    req = request(KEYS)
    req.key_array = np.array(KEYS, dtype=np.uint64)
    monkeypatch.setattr(index_module, "as_key_array", _no_conversion)
    pl = policy(name).choose(req, c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (0, 6)
