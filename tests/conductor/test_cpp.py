import pytest
from mooncake_conductor.cpp import plan_cpp

from .helpers import COST


def test_single_stage_equals_chunked_prefill() -> None:
    plan = plan_cpp(COST, 8192, 0, 1, 8192)
    assert plan.makespan_s == pytest.approx(COST.prefill_compute_time(8192))
    assert plan.chunks == ((0, 8192),)


def test_pipeline_makespan_formula() -> None:
    plan = plan_cpp(COST, 32768, 4096, 4, 4096)
    assert plan.chunks[0] == (4096, 8192) and plan.chunks[-1][1] == 32768
    assert plan.makespan_s == pytest.approx(sum(plan.stage_s) + 3 * max(plan.stage_s))
    assert plan.gpu_seconds == pytest.approx(4 * plan.makespan_s)


def test_cpp_cuts_latency_of_long_prompts() -> None:
    single = COST.prefill_time(100_000)
    plan = plan_cpp(COST, 100_000, 0, 4, 4096)
    assert plan.makespan_s < single / 2.5
    assert plan.gpu_seconds > single  # pipeline bubbles cost capacity


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        plan_cpp(COST, 1000, 0, 0, 512)
    with pytest.raises(ValueError):
        plan_cpp(COST, 1000, 0, 2, 0)
