"""The gateway's side of decode calibration: a relayed stream's TBT, in modelled seconds,
reported against the decode selector's prediction (ModelRuntime.decode_observed)."""

from __future__ import annotations

import pytest
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_gateway.runtime import ModelRuntime
from mooncake_gateway.settings import GatewaySettings, ModelSettings


def _runtime(enabled: bool, time_scale: float = 0.5) -> ModelRuntime:
    cfg = ModelSettings(name="m", time_scale=time_scale,
                        conductor={"decode_calibration": {"enabled": enabled, "rate": 1.0}})
    return ModelRuntime(cfg, GatewaySettings(), GatewayMetrics())


def test_a_stream_slower_than_predicted_scales_decode_steps() -> None:
    rt = _runtime(True)
    base = rt.cost.decode_step_time(8, 8 * 2048)
    # 63 wall intervals of 20 ms and 7 of 40 ms: TBT (the longest tenth's mean) 40 ms
    # wall = 80 ms modelled at time scale 0.5, against 40 ms predicted: 2x
    rt.load.decode_observed(0.04, [0.02] * 63 + [0.04] * 7)
    assert rt.cost.decode_scale == pytest.approx(2.0)
    assert rt.cost.decode_step_time(8, 8 * 2048) == pytest.approx(2.0 * base)
    cal = rt.reports.state()["calibration"]
    assert cal["decode_scale"] == pytest.approx(2.0) and cal["observed_decodes"] == 1


def test_off_unpredicted_or_empty_streams_change_nothing() -> None:
    off = _runtime(False)
    off.load.decode_observed(0.04, [0.2] * 20)
    on = _runtime(True)
    on.load.decode_observed(0.0, [0.2] * 20)  # another instance than the selector's choice
    on.load.decode_observed(0.04, [])
    for rt in (off, on):
        assert rt.cost.decode_scale == 1.0
        assert rt.reports.state()["calibration"]["observed_decodes"] == 0
