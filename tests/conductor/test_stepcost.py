"""One engine step's time: a single forward pass for every prefill chunk and decode in it."""

from __future__ import annotations

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.stepcost import chunked_prefill_time, decode_share_time, mixed_step_time

COST = CostModel()


@pytest.mark.parametrize(("batch", "context"), [(1, 1000), (32, 300_000), (128, 1_200_000)])
def test_a_step_with_no_prefill_is_the_cost_models_decode_step(batch: int, context: int) -> None:
    assert mixed_step_time(COST, batch, context, 0.0, 0) == COST.decode_step_time(batch, context)


@pytest.mark.parametrize(("prior", "new"), [(0, 512), (0, 4096), (8192, 2048)])
def test_a_step_with_only_a_chunk_is_its_prefill_cost(prior: int, new: int) -> None:
    flops = COST.flops(prior + new) - COST.flops(prior)
    step = mixed_step_time(COST, 0, 0, flops, new)
    assert step == pytest.approx(COST.prefill_compute_time(prior + new, prior), rel=1e-9)


def test_a_chunk_slows_the_decodes_it_shares_the_step_with() -> None:
    alone = mixed_step_time(COST, 16, 100_000, 0.0, 0)
    mixed = mixed_step_time(COST, 16, 100_000, COST.flops(2048), 2048)
    assert mixed > alone + 0.5 * COST.prefill_compute_time(2048)
    assert decode_share_time(COST, 0, 0) == 0.0


def test_loading_a_cached_prefix_overlaps_the_pass() -> None:
    flops = COST.flops(2048)
    compute = mixed_step_time(COST, 0, 0, flops, 2048)
    assert mixed_step_time(COST, 0, 0, flops, 2048, load_tokens=1000) == compute
    huge = 2_000_000
    assert mixed_step_time(COST, 0, 0, flops, 2048, load_tokens=huge) == COST.h2d_time(huge)


def test_a_step_of_several_prompts_is_one_pass_not_one_per_prompt() -> None:
    flops = 8 * COST.flops(1000)
    step = mixed_step_time(COST, 0, 0, flops, 8000)
    one_pass_each = 8 * COST.prefill_compute_time(1000)
    # one fixed cost and the MFU of 8,000 new tokens: cheaper than eight passes ...
    assert step < 0.85 * one_pass_each
    # ... yet never cheaper than the FLOPs at the MFU ceiling
    assert step > flops / (COST.config.hardware.peak_flops * COST.config.efficiency.mfu_max)


@pytest.mark.parametrize(("n", "cached"), [(1000, 0), (8192, 0), (8193, 0), (30_000, 0),
                                           (30_000, 12_000), (30_000, 25_000)])
def test_a_prompt_longer_than_the_budget_runs_as_several_passes(n: int, cached: int) -> None:
    budget = 8192
    got = chunked_prefill_time(COST, n, cached, budget, cached_in_hbm=cached)
    passes = -(-(n - cached) // budget)
    if passes == 1:
        assert got == COST.prefill_time(n, cached, cached)
        return
    want = sum(COST.prefill_compute_time(min(n, s + budget), s)
               for s in range(cached, n, budget))
    assert got == pytest.approx(want)
    # the same FLOPs as one pass, but a fixed cost per pass and each at a chunk's MFU
    assert got > COST.prefill_time(n, cached, cached) + (passes - 1) * COST.prefill_overhead_s


def test_a_chunked_prompt_overlaps_loading_its_prefix_from_host_memory() -> None:
    compute = chunked_prefill_time(COST, 20_000, 2_000, 8192, cached_in_hbm=2_000)
    assert chunked_prefill_time(COST, 20_000, 2_000, 8192) == max(compute, COST.h2d_time(2_000))
    assert chunked_prefill_time(COST, 20_000, 2_000, 0) == COST.prefill_time(20_000, 2_000)
