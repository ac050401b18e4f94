"""Chunked pipeline parallelism: argument checks and the smallest legal chunk."""

from __future__ import annotations

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.cpp import plan_cpp


def test_bad_arguments_name_the_argument() -> None:
    cm = CostModel()
    with pytest.raises(ValueError, match=r"^group_size must be at least 1$"):
        plan_cpp(cm, 1000, 0, 0, 512)
    with pytest.raises(ValueError, match=r"^chunk_tokens must be positive$"):
        plan_cpp(cm, 1000, 0, 2, 0)


def test_one_token_chunks_are_allowed() -> None:
    cm = CostModel()
    plan = plan_cpp(cm, 3, 0, 1, 1)
    assert plan.chunks == ((0, 1), (1, 2), (2, 3))
    want = [cm.prefill_compute_time(e, s) for s, e in plan.chunks]
    assert plan.stage_s == pytest.approx(want, rel=1e-12)
    assert plan.makespan_s == pytest.approx(sum(want), rel=1e-12)  # one stage: no bubbles
