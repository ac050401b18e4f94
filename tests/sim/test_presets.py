"""A preset's simulation: what it names, and what a caller may change."""

from __future__ import annotations

import pytest
from mooncake_sim.presets import PRESETS
from pydantic import ValidationError


def test_the_preset_names_its_pools_caches_slos_and_realism() -> None:
    preset = PRESETS["paper-fig5"]
    cfg = preset.sim_config("kvcache-centric", 1.87)
    assert (cfg.prefill, cfg.decode, cfg.speed) == (16, 16, 1.87)
    assert cfg.prefill_cache_tokens == 3_000_000
    assert (cfg.prediction_error, cfg.model_bias, cfg.event_lag_ms, cfg.nic_contention) == (
        0.2, 0.0, 100.0, True)
    assert cfg.conductor.policy == "kvcache-centric"
    assert (cfg.conductor.slo.ttft_s, cfg.conductor.slo.tbt_s) == (30.0, 0.1)


def test_overrides_replace_fields_and_conductor_fields_are_added() -> None:
    cfg = PRESETS["paper-fig5"].sim_config(
        "conductor", 2.0, prefill=4, model_bias=0.25, conductor={"seed": 3})
    assert (cfg.prefill, cfg.decode, cfg.model_bias) == (4, 16, 0.25)
    assert cfg.conductor.seed == 3 and cfg.conductor.slo.ttft_s == 30.0


def test_a_bad_override_is_refused_by_field() -> None:
    with pytest.raises(ValidationError, match="prefill"):
        PRESETS["paper-fig5"].sim_config("conductor", 1.0, prefill=0)
