"""The cost model's formulas checked against numbers worked out by hand from the paper's
setting (LLaMA3-70B on one 8xA800 node, FAST'25 Table 1, with the A800 data-sheet
figures in the defaults), and the offline prefill predictor's fit.

Every model here is built inside its test: the constants are computed in
``CostModel.__init__``, so a model made at import time would not show a wrong constant.
"""

from __future__ import annotations

import pytest
from mooncake_conductor.cost import (
    CostModel,
    CostModelConfig,
    EfficiencySpec,
    HardwareSpec,
    ModelSpec,
    PrefillPredictor,
    fit_prefill_efficiency,
    fit_prefill_predictor,
    prediction_errors,
)

KV = 80 * (2 * 8192 // 8) * 2  # bytes of KV per token: 327 680 (320 KiB)
PEAK = 8 * 312e12  # FLOP/s of the node


def _flops(n: float) -> float:
    """l * (a*n^2*d + b*n*d^2) with l=80, a=4, b=22, d=8192."""
    return 80 * (4 * n * n * 8192 + 22 * n * 8192 * 8192)


def _mfu(new: float) -> float:
    return 0.5 * new / (new + 256)


def test_kv_capacity_is_the_usable_share_of_hbm_left_after_the_weights() -> None:
    cm = CostModel()
    # 8 x 80 GB = 640 GB, minus 70.6e9 params x 2 bytes = 498.8 GB, x 0.9 usable,
    # / 327 680 bytes = 1 369 995.1 tokens
    assert cm.kv_capacity_tokens == 1_369_995
    # a model whose weights do not fit leaves no room at all (not a negative count)
    big = CostModel(CostModelConfig(model=ModelSpec(params=400e9)))  # 800 GB of weights
    assert big.kv_capacity_tokens == 0
    # exactly the weights plus one token's KV / 0.9 in HBM: room for one token
    one = CostModel(CostModelConfig(
        model=ModelSpec(params=1e9),
        hardware=HardwareSpec(gpus=1, hbm_gb_per_gpu=2.0 + KV / 0.9 / 1e9 * 1.5)))
    assert one.kv_capacity_tokens == 1


def test_kv_capacity_is_the_floor_of_exact_byte_arithmetic() -> None:
    # a 16-byte-per-token model (1 layer, d=8, no GQA, 1-byte elements) on one 1 GB GPU
    # whose weights leave 16 000 - 1 bytes: one byte short of 1000 tokens
    spec = ModelSpec(layers=1, d_model=8, gqa=1, elem_bytes=1, params=1e9 - 16_000 + 1)
    cm = CostModel(CostModelConfig(
        model=spec, hardware=HardwareSpec(gpus=1, hbm_gb_per_gpu=1.0),
        efficiency=EfficiencySpec(kv_hbm_fraction=1.0)))
    assert cm.kv_bytes_per_token == 16
    assert cm.kv_capacity_tokens == 999
    room = CostModel(CostModelConfig(
        model=spec.model_copy(update={"params": 1e9 - 16_000}),
        hardware=HardwareSpec(gpus=1, hbm_gb_per_gpu=1.0),
        efficiency=EfficiencySpec(kv_hbm_fraction=1.0)))
    assert room.kv_capacity_tokens == 1000


def test_transfer_over_the_slower_link_and_h2d_load_times() -> None:
    cm = CostModel()
    # 1000 tokens = 327.68 MB; the link: min(800 Gbit/s = 100 GB/s, 128 GB/s) x 0.9
    assert cm.transfer_time(1000) == pytest.approx(327.68e6 / 90e9, rel=1e-12)
    assert cm.transfer_time(1) == pytest.approx(KV / 90e9, rel=1e-12)  # one token moves too
    assert cm.h2d_time(1000) == pytest.approx(327.68e6 / 115.2e9, rel=1e-12)
    # a faster NIC than the PCIe bus: the bus is the link
    fast = CostModel(CostModelConfig(hardware=HardwareSpec(nic_gbits_per_s=3200.0)))
    assert fast.transfer_time(1000) == pytest.approx(327.68e6 / 115.2e9, rel=1e-12)


def test_decode_step_compute_bound_by_hand() -> None:
    cm = CostModel()
    batch, ctx = 256, 256_000
    # weights 141.2 GB + 256k tokens of KV over 8 x 2039 GB/s x 0.7
    mem = (141.2e9 + ctx * KV) / (8 * 2039e9 * 0.7)
    # 2 x 70.6e9 FLOPs per sequence plus 4*l*d attention FLOPs per context token,
    # over the peak x 0.4 decode MFU
    compute = (batch * 2 * 70.6e9 + ctx * 4 * 80 * 8192) / (PEAK * 0.4)
    assert compute > mem  # a big batch is compute-bound
    assert cm.decode_step_time(batch, ctx) == pytest.approx(0.003 + compute, rel=1e-12)
    assert cm.decode_step_time(1, 0) == pytest.approx(
        0.003 + 141.2e9 / (8 * 2039e9 * 0.7), rel=1e-12)


def test_prefill_compute_time_by_hand() -> None:
    cm = CostModel()
    for n, cached in ((1000, 0), (2000, 1000), (1000, 999), (8192, 4096)):
        new = n - cached
        want = 0.010 + (_flops(n) - _flops(cached)) / (PEAK * _mfu(new))
        assert cm.prefill_compute_time(n, cached) == pytest.approx(want, rel=1e-12)
        assert cm.prefill_time(n, cached, cached_in_hbm=cached) == pytest.approx(want, rel=1e-12)


def test_mfu_curve_and_its_guard() -> None:
    cm = CostModel()
    assert cm.mfu(256) == pytest.approx(0.25, rel=1e-12)  # half of mfu_max at 256 tokens
    assert cm.mfu(1) == pytest.approx(0.5 / 257, rel=1e-12)
    assert cm.mfu(0) == 0.5  # no new tokens: the ceiling, never a zero divisor
    assert cm.mfu(-3) == 0.5


def test_nothing_to_compute_or_load_takes_only_the_overhead() -> None:
    no_overhead = CostModel(CostModelConfig(efficiency=EfficiencySpec(prefill_overhead_s=0.0)))
    # a fully cached prompt already in HBM: no compute, no load, no overhead
    assert no_overhead.prefill_time(100, 100, cached_in_hbm=100) == 0.0
    assert no_overhead.prefill_compute_time(100, 100) == 0.0


def test_queue_time_counts_running_and_queued_work() -> None:
    assert CostModel.queue_time([]) == 0.0
    assert CostModel.queue_time([0.5, 0.25]) == 0.75
    assert CostModel.queue_time([0.5, -1.0], running_remaining_s=0.125) == 0.625
    assert CostModel.queue_time([], running_remaining_s=-2.0) == 0.0


def test_set_prefill_scale_error_message() -> None:
    with pytest.raises(ValueError, match=r"^scale must be positive$"):
        CostModel().set_prefill_scale(0.0)


# -- the predictor ----------------------------------------------------------------------


COEF = (0.02, 0.05, -0.01, 0.004, 0.001, -0.002)  # per thousand tokens


def _truth(n: float, p: float) -> float:
    x, y = n / 1000.0, p / 1000.0
    return (COEF[0] + COEF[1] * x + COEF[2] * y + COEF[3] * x * x + COEF[4] * y * y
            + COEF[5] * x * y)


SAMPLES = [(float(n), float(p), _truth(n, p))
           for n in (1000, 2000, 4000, 8000, 16000) for p in (0, n // 4, n // 2)]


def test_fit_recovers_the_coefficients_in_thousands_of_tokens() -> None:
    fit = fit_prefill_predictor(SAMPLES)
    assert fit.scale == 1000.0
    assert fit.coefficients == pytest.approx(COEF, rel=1e-6, abs=1e-9)
    assert fit.samples == len(SAMPLES)
    assert fit.max_abs_pct_error < 1e-4


def test_a_hand_made_predictor_evaluates_its_polynomial() -> None:
    pred = PrefillPredictor(coefficients=COEF, scale=1000.0)
    assert pred.predict(4000.0, 1000.0) == pytest.approx(_truth(4000, 1000), rel=1e-12)
    assert pred.predict(4000.0) == pytest.approx(_truth(4000, 0), rel=1e-12)  # p defaults to 0
    assert PrefillPredictor(coefficients=(-1.0, 0, 0, 0, 0, 0)).predict(5.0) == 0.0  # floor


def test_a_predictor_with_the_wrong_number_of_coefficients_fails_loudly() -> None:
    with pytest.raises(ValueError):
        PrefillPredictor(coefficients=(1.0, 2.0)).predict(1000.0)


def test_ridge_shrinks_the_coefficients() -> None:
    """Ridge regression: a positive ``ridge`` gives a smaller coefficient vector (L2) than
    plain least squares, and fits the samples less closely."""
    plain = fit_prefill_predictor(SAMPLES, ridge=0.0)
    for ridge in (0.1, 10.0):
        shrunk = fit_prefill_predictor(SAMPLES, ridge=ridge)
        assert sum(c * c for c in shrunk.coefficients) < sum(c * c for c in plain.coefficients)
        assert shrunk.max_abs_pct_error > plain.max_abs_pct_error


def test_fit_errors_are_relative_to_measured_values_below_a_second() -> None:
    # quick prefills (well under a second) with a cubic term the fit cannot follow
    samples = [(float(n), 0.0, 0.01 + 1e-12 * n ** 3) for n in range(1000, 9000, 1000)]
    fit = fit_prefill_predictor(samples)
    errs = [abs(fit.predict(n, p) - t) / t for n, p, t in samples]
    assert fit.mean_abs_pct_error == pytest.approx(100 * sum(errs) / len(errs), rel=1e-9)
    assert fit.max_abs_pct_error == pytest.approx(100 * max(errs), rel=1e-9)
    assert fit.max_abs_pct_error > 0


def test_fit_errors_skip_zero_second_samples() -> None:
    # one measured sample with a time: its error is both the mean and the max
    samples = [(float(n), 0.0, 0.0) for n in range(1000, 7000, 1000)] + [(7000.0, 0.0, 0.5)]
    fit = fit_prefill_predictor(samples)
    err = 100 * abs(fit.predict(7000.0) - 0.5) / 0.5
    assert fit.mean_abs_pct_error == pytest.approx(err, rel=1e-9)
    assert fit.max_abs_pct_error == pytest.approx(err, rel=1e-9)
    assert err > 0
    # no sample with a time at all: no error to report
    zeros = fit_prefill_predictor([(float(n), 0.0, 0.0) for n in range(1000, 7000, 1000)])
    assert zeros.mean_abs_pct_error == 0.0 and zeros.max_abs_pct_error == 0.0


def test_singular_fit_error_message() -> None:
    with pytest.raises(ValueError,
                       match=r"^singular system: samples do not determine the polynomial$"):
        fit_prefill_predictor([(1000.0, 0.0, 1.0)] * 6, ridge=0.0)


# -- fitting the prefill formula's efficiency terms to measurements ---------------------------

def _truth_model(a: float = 2.5, mfu_max: float = 0.6, half: float = 128.0,
                 overhead: float = 0.02) -> CostModel:
    return CostModel(CostModelConfig(
        model=ModelSpec(flops_a=a),
        efficiency=EfficiencySpec(mfu_max=mfu_max, mfu_half_tokens=half,
                                  prefill_overhead_s=overhead)))


def _measured(cm: CostModel) -> list[tuple[int, int, float]]:
    return [(x + p, p, cm.prefill_compute_time(x + p, p))
            for x in (64, 256, 1024, 4096, 16384, 65536) for p in (0, 4096, 32768)]


def test_efficiency_fit_recovers_the_terms_that_made_the_samples() -> None:
    samples = _measured(_truth_model())
    fit = fit_prefill_efficiency(samples, CostModelConfig())
    assert fit.flops_a == 2.5 and fit.mfu_half_tokens == 128.0  # both on the grids
    assert fit.mfu_max == pytest.approx(0.6, rel=1e-9)
    assert fit.prefill_overhead_s == pytest.approx(0.02, rel=1e-9)
    assert fit.max_abs_pct_error < 1e-6 and fit.samples == len(samples)


def test_efficiency_fit_keeps_a_held_coefficient_and_reports_what_it_costs() -> None:
    """Samples from a = 2 fitted with a held at the paper's 4: the fit keeps 4 and its
    error is what the wrong attention count leaves (long prompts weigh attention most)."""
    samples = _measured(_truth_model(a=2.0))
    held = fit_prefill_efficiency(samples, CostModelConfig(), flops_a=(4.0,))
    assert held.flops_a == 4.0
    assert held.max_abs_pct_error > 10.0
    free = fit_prefill_efficiency(samples, CostModelConfig())
    assert free.flops_a == 2.0 and free.mean_abs_pct_error < held.mean_abs_pct_error


def test_efficiency_fit_errors_match_the_fitted_model() -> None:
    """The reported errors are those of a cost model built from the fitted terms."""
    samples = [(n, p, t * (1.1 if n % 2 else 0.95))  # noisy measurements
               for n, p, t in _measured(_truth_model())]
    fit = fit_prefill_efficiency(samples, CostModelConfig())
    cm = CostModel(fit.applied_to(CostModelConfig()))
    assert cm.config == _truth_model(fit.flops_a, fit.mfu_max, fit.mfu_half_tokens,
                                     fit.prefill_overhead_s).config
    mean, worst = prediction_errors(cm.prefill_compute_time, samples)
    assert fit.mean_abs_pct_error == pytest.approx(mean, rel=1e-9)
    assert fit.max_abs_pct_error == pytest.approx(worst, rel=1e-9)


def test_prediction_errors_are_relative_to_the_measured_time() -> None:
    mean, worst = prediction_errors(lambda n, p: 1.0, [(10, 0, 2.0), (10, 0, 0.5), (10, 0, 1.0)])
    assert mean == pytest.approx(100 * (0.5 + 1.0 + 0.0) / 3)
    assert worst == pytest.approx(100.0)
    with pytest.raises(ValueError):
        prediction_errors(lambda n, p: 1.0, [(10, 0, 0.0)])


@pytest.mark.parametrize("bad", [(100, 100, 1.0), (100, -1, 1.0), (0, 0, 1.0), (100, 0, 0.0),
                                 (100, 0, float("nan"))])
def test_efficiency_fit_rejects_a_sample_it_cannot_use(bad: tuple[int, int, float]) -> None:
    good = _measured(_truth_model())
    with pytest.raises(ValueError, match="bad sample"):
        fit_prefill_efficiency([*good, bad], CostModelConfig())


def test_efficiency_fit_needs_three_samples_and_a_possible_efficiency() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit_prefill_efficiency(_measured(_truth_model())[:2], CostModelConfig())
    # faster than the peak allows: no mfu_max in (0, 1] explains it
    too_fast = [(n, p, t / 10.0) for n, p, t in _measured(_truth_model(mfu_max=0.5))]
    with pytest.raises(ValueError, match="no efficiency"):
        fit_prefill_efficiency(too_fast, CostModelConfig(), flops_a=(2.5,))
