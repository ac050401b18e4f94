"""Chunked pipeline parallelism: argument checks, the smallest legal chunk, the
chunk-size planner and the shortcuts policies price groups with."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake_conductor.cost import CostModel
from mooncake_conductor.cpp import (
    ChunkPricer,
    CPPConfig,
    choose_chunk,
    cpp_makespan,
    first_stage_s,
    plan_cpp,
    plan_cpp_for,
)
from pydantic import ValidationError


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


# -- the chunk-size planner (plan_cpp_for) --------------------------------------------------
@pytest.mark.parametrize(("n", "cached", "group"), [(100_000, 0, 4), (60_000, 0, 3),
                                                     (12_000, 0, 2), (120_000, 16_384, 4)])
def test_planned_chunks_are_the_shortest_makespan_of_the_choices(
        n: int, cached: int, group: int) -> None:
    cm = CostModel()
    cfg = CPPConfig()
    plans = {c: plan_cpp(cm, n, cached, group, c) for c in cfg.chunk_choices}
    got = plan_cpp_for(cm, n, cached, group, cfg)
    assert got.makespan_s == min(p.makespan_s for p in plans.values())
    assert got == plans[got.chunk_tokens]


def test_the_planner_is_not_always_one_size() -> None:
    cm = CostModel()
    sizes = {plan_cpp_for(cm, n, 0, g, CPPConfig()).chunk_tokens
             for n, g in [(10_240, 4), (100_000, 4), (100_000, 2)]}
    assert len(sizes) > 1


def test_a_fixed_chunk_is_used_as_given() -> None:
    cm = CostModel()
    got = plan_cpp_for(cm, 100_000, 0, 4, CPPConfig(chunk_tokens=8192))
    assert got == plan_cpp(cm, 100_000, 0, 4, 8192) and got.chunk_tokens == 8192


def test_on_a_tie_the_smaller_chunk_wins() -> None:
    # 1000 tokens are one chunk whatever the size: every choice plans the same pipeline
    cm = CostModel()
    got = plan_cpp_for(cm, 1000, 0, 2, CPPConfig(chunk_choices=(4096, 1024, 2048)))
    assert got.chunk_tokens == 1024
    assert got.makespan_s == plan_cpp(cm, 1000, 0, 2, 4096).makespan_s


@pytest.mark.parametrize("cfg", [{"chunk_choices": ()}, {"chunk_choices": (0, 1024)},
                                 {"chunk_tokens": -1}])
def test_bad_chunk_settings_are_refused(cfg: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CPPConfig(**cfg)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 200_000), cached_share=st.floats(0, 1), group=st.integers(1, 6),
       chunk=st.sampled_from([1, 7, 512, 1000, 1024, 2048, 4096, 8192, 300_000]))
def test_the_closed_form_makespan_equals_the_plans(n: int, cached_share: float, group: int,
                                                     chunk: int) -> None:
    cm = CostModel()
    cached = int(n * cached_share)
    if chunk == 1 and n - cached > 5000:
        chunk = 64  # keep the reference loop short
    want = plan_cpp(cm, n, cached, group, chunk).makespan_s
    assert cpp_makespan(cm, n, cached, group, chunk) == pytest.approx(want, rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 200_000), cached=st.integers(-10, 210_000), group=st.integers(1, 8),
       chunk=st.sampled_from([1, 7, 512, 1000, 1024, 2048, 4096, 8192, 300_000]))
def test_the_first_stage_is_the_plans_to_the_bit(n: int, cached: int, group: int,
                                                 chunk: int) -> None:
    cm = CostModel()
    if chunk < 64 and n - max(cached, 0) > 5000:
        chunk = 64  # keep the reference loop short
    # exactly equal: the simulator starts staggered groups on the plan's stage 0
    assert first_stage_s(cm, n, cached, group, chunk) == plan_cpp(
        cm, n, cached, group, chunk).stage_s[0]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 200_000), cached=st.integers(-10, 210_000),
       choices=st.lists(st.integers(1, 20_000), min_size=1, max_size=5, unique=True),
       fixed=st.sampled_from([0, 0, 3000]))
def test_a_pricer_gives_choose_chunks_numbers_for_every_group(
        n: int, cached: int, choices: list[int], fixed: int) -> None:
    cm = CostModel()
    cfg = CPPConfig(chunk_choices=tuple(choices), chunk_tokens=fixed)
    pricer = ChunkPricer(cm, n, cached, cfg)
    for group in (4, 1, 2, 3, 2):  # any order, asked again: the cached spans serve them
        # the reference: each size's makespan on its own, the smaller size on a tie
        want = (fixed, cpp_makespan(cm, n, cached, group, fixed)) if fixed else (0, math.inf)
        for size in ([] if fixed else sorted(choices)):
            span = cpp_makespan(cm, n, cached, group, size)
            if span < want[1] * (1.0 - 1e-9):
                want = (size, span)
        assert pricer.choose(group) == want
        assert choose_chunk(cm, n, cached, group, cfg) == want
