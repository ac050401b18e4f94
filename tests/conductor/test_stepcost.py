"""One engine step's time: a single forward pass for every prefill chunk and decode in it."""

from __future__ import annotations

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.stepcost import decode_share_time, mixed_step_time

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
