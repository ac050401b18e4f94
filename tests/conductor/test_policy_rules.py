"""Baseline policies' rules and the shared helpers, on hand-made instances."""

import random

from mooncake_conductor.policies.base import Placement, least, longest

from .helpers import BT, COST, cluster, policy, queue, request

KEYS = list(range(20))  # 10240 tokens
N = 20 * BT


def test_aibrix_matched_tokens_add_to_the_estimate() -> None:
    """AIBrix per pod: ``queued * avg_prefill_ms + (0.005 * matched + 1) + (0.001 *
    unmatched^1.5 + 5)``. Pod 0 holds the whole prompt and has one request queued
    (1036 ms); pod 1 holds nothing:
    pod 0: 1036 + 52.2 + 5 = 1093.2 ms; pod 1: 1 + 1036.2 + 5 = 1042.2 ms."""
    c = cluster(2)
    c.index.store(0, KEYS)
    queue(c.prefill[0], 1.0)
    c.prefill[0].avg_prefill_s = 1.036
    pl = policy("aibrix-conductor").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1 and pl.local_blocks == 0
    c.prefill[0].avg_prefill_s = 0.98  # 1037.2 ms: now pod 0
    pl = policy("aibrix-conductor").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 0 and pl.local_blocks == 20
    assert pl.prefill_s == COST.prefill_time(N, N)


def test_least_load_counts_the_running_prefill_in_its_queue() -> None:
    # instance 0 runs a prefill for 10 more seconds with nothing queued; instance 1 has
    # 1 s queued: the strongest reading of T_queue sees 10 s against 1 s
    c = cluster(2)
    c.prefill[0].busy_until = 10.0
    queue(c.prefill[1], 1.0)
    pl = policy("least-load").choose(request(KEYS), c, 0.0)
    assert pl.prefill == 1
    assert pl.queue_s == 1.0


def test_least_load_placement_reuses_the_chosen_instances_cache() -> None:
    c = cluster(2)
    c.index.store(0, KEYS[:8])
    queue(c.prefill[1], 1.0)
    pl = policy("least-load").choose(request(KEYS), c, 0.0)
    assert (pl.prefill, pl.local_blocks) == (0, 8)
    assert pl.prefill_s == COST.prefill_time(N, 8 * BT)


def test_least_ties_within_a_relative_tolerance() -> None:
    rng = random.Random(0)
    near = [(1.0, 0), (1.0 + 1e-10, 1), (2.0, 2)]
    assert {least(near, rng) for _ in range(40)} == {0, 1}
    far = [(1.0, 0), (1.0 + 1e-8, 1)]
    assert {least(far, rng) for _ in range(40)} == {0}
    assert {least([(0.0, 5), (0.0, 7)], rng) for _ in range(40)} == {5, 7}
    assert least([(3.0, 4)], rng) == 4


def test_longest_takes_the_first_holder_on_ties() -> None:
    assert longest({3: 5, 1: 5, 2: 4}) == (3, 5)
    assert longest({2: 4, 1: 6}) == (1, 6)
    assert longest({}) == (None, 0)
    assert longest({4: 0}) == (None, 0)


def test_placement_derived_fields() -> None:
    pl = Placement(prefill=0, local_blocks=3, fetch_blocks=4, queue_s=1.0, transfer_s=0.5,
                   prefill_s=2.0)
    assert pl.ttft_s == 3.5 and pl.reused_blocks == 7 and pl.gpu_seconds == 2.0
    pl.cpp_group = [0, 1, 2]
    assert pl.gpu_seconds == 6.0
