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


def test_stages_by_hand() -> None:
    """10000 tokens, 1000 cached, 2 stages, 4096-token chunks: chunks start past the
    cache, the last is cut at the prompt's end; each stage is half the chunk's compute
    plus handing its activations (tokens x d_model x 2 bytes) over the NIC."""
    plan = plan_cpp(COST, 10_000, 1000, 2, 4096)
    assert plan.chunks == ((1000, 5096), (5096, 9192), (9192, 10_000))
    nic = 800e9 / 8 * 0.9
    want = [COST.prefill_compute_time(e, s) / 2 + (e - s) * 8192 * 2 / nic
            for s, e in plan.chunks]
    assert plan.stage_s == pytest.approx(want, rel=1e-12)
    assert plan.makespan_s == pytest.approx(sum(want) + max(want), rel=1e-12)


def test_a_fully_cached_prompt_is_one_empty_pass() -> None:
    plan = plan_cpp(COST, 4096, 4096, 3, 1024)
    assert plan.chunks == ((4096, 4096),)
    assert plan.stage_s == (0.010,)  # the per-pass overhead
    assert plan.makespan_s == pytest.approx(0.010 * 3)
