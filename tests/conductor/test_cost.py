import math

import pytest
from mooncake_conductor.cost import (
    CostModel,
    CostModelConfig,
    EfficiencySpec,
    ModelSpec,
    fit_prefill_predictor,
)

PAPER = CostModel()  # LLaMA3-70B on 8xA800, FAST'25 Table 1


def test_kv_bytes_per_token_is_320_kib() -> None:
    # p * l * (2*d/gqa) * s = 80 * 2048 * 2
    assert PAPER.kv_bytes_per_token == 327_680
    assert PAPER.kv_bytes(1000) == 327_680_000


@pytest.mark.parametrize("n", [1, 512, 8192, 128_000])
def test_flops_formula(n: int) -> None:
    layers, d, a, b = 80, 8192, 4, 22
    expected = layers * (a * n * n * d + b * n * d * d)
    assert PAPER.flops(n) == pytest.approx(expected, rel=1e-12)


def test_reuse_breakeven_about_6_gbps_for_8k_prefix() -> None:
    # paper §3: "for an 8k prefix this needs about 6 GB/s on 8xA800"
    bw = PAPER.reuse_breakeven_bandwidth(8192)
    assert 5.5e9 < bw < 6.5e9


def test_prefill_time_from_flops_over_mfu() -> None:
    cfg = CostModelConfig(
        efficiency=EfficiencySpec(mfu_max=0.5, mfu_half_tokens=0, prefill_overhead_s=0.0)
    )
    cm = CostModel(cfg)
    n = 8192
    expected = PAPER.flops(n) / (8 * 312e12 * 0.5)
    assert cm.prefill_time(n) == pytest.approx(expected, rel=1e-9)
    # reusing p tokens saves exactly flops(p)
    p = 4096
    saved = (PAPER.flops(n) - PAPER.flops(p)) / (8 * 312e12 * 0.5)
    assert cm.prefill_compute_time(n, p) == pytest.approx(saved, rel=1e-9)


def test_prefill_monotone_and_cache_helps() -> None:
    assert PAPER.prefill_time(4096) < PAPER.prefill_time(8192) < PAPER.prefill_time(16384)
    assert PAPER.prefill_time(16384, 8192) < PAPER.prefill_time(16384)
    # fully cached: nothing to compute, only the prefix to load from host memory
    assert PAPER.prefill_time(16384, 16384) == pytest.approx(
        max(PAPER.config.efficiency.prefill_overhead_s, PAPER.h2d_time(16384))
    )
    assert PAPER.prefill_time(16384, 16384, cached_in_hbm=16384) == pytest.approx(
        PAPER.config.efficiency.prefill_overhead_s
    )


def test_cached_prefix_load_overlaps_compute() -> None:
    cm = CostModel(CostModelConfig(hardware={"h2d_gbytes_per_s": 0.01}))
    # with a uselessly slow host link, loading the prefix dominates the pass
    t = cm.prefill_time(8192, 8000)
    assert t == pytest.approx(cm.h2d_time(8000))
    assert cm.prefill_time(8192, 8000, cached_in_hbm=8000) < t


def test_transfer_uses_slower_link() -> None:
    # B = min(B_nic = 100 GB/s, B_h2d = 128 GB/s) x efficiency 0.9
    assert PAPER.transfer_time(10_000) == pytest.approx(10_000 * 327_680 / (100e9 * 0.9))
    assert PAPER.transfer_time(0) == 0.0


def test_decode_step_grows_with_batch_and_context() -> None:
    assert PAPER.decode_step_time(0, 0) == 0.0
    one = PAPER.decode_step_time(1, 1000)
    # one sequence: memory-bound, weights 141 GB over 16.3 TB/s x 0.7, plus overhead
    assert one == pytest.approx(0.003 + (70.6e9 * 2 + 1000 * 327_680) / (8 * 2039e9 * 0.7))
    assert PAPER.decode_step_time(64, 800_000) > PAPER.decode_step_time(16, 200_000) > one


def test_queue_time() -> None:
    assert CostModel.queue_time([1.0, 2.0], 0.5) == 3.5
    assert CostModel.queue_time([], -1.0) == 0.0


def test_fit_recovers_a_known_polynomial() -> None:
    def truth(n: float, p: float) -> float:
        return 0.01 + 1e-4 * (n - p) + 3e-9 * (n * n - p * p)

    samples = [(n, p, truth(n, p)) for n in range(1000, 33000, 4000) for p in (0, n // 4, n // 2)]
    fit = fit_prefill_predictor(samples)
    assert fit.max_abs_pct_error < 1e-3
    assert fit.predict(20000, 5000) == pytest.approx(truth(20000, 5000), rel=1e-4)


def test_fit_on_cost_model_reports_error() -> None:
    samples = [
        (n, p, PAPER.prefill_time(n, p))
        for n in range(512, 65536, 2048)
        for p in (0, n // 3, (2 * n) // 3)
    ]
    fit = fit_prefill_predictor(samples)
    assert fit.samples == len(samples)
    # the model is quadratic in (n, p) where compute dominates: the fit recovers it
    assert fit.mean_abs_pct_error < 1.0
    assert math.isfinite(fit.max_abs_pct_error)


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(ValueError, match="at least"):
        fit_prefill_predictor([(1, 0, 1.0)])
    with pytest.raises(ValueError, match="bad sample"):
        fit_prefill_predictor([(100, 200, 1.0)] * 6)


def test_decode_kv_capacity_is_the_usable_share_of_hbm_left_after_weights() -> None:
    # (8 GPUs x 80 GB - 70.6e9 params x 2 bytes) x 0.9 usable / 320 KiB per token
    assert PAPER.kv_capacity_tokens == int((640e9 - 141.2e9) * 0.9 / 327_680)
    assert PAPER.kv_capacity_tokens == 1_369_995


def test_transfer_and_load_times_by_hand() -> None:
    # 1000 tokens = 327.68 MB over min(800 Gbit/s NIC, 128 GB/s H2D) x 0.9 efficiency
    assert PAPER.transfer_time(1000) == pytest.approx(327.68e6 / (100e9 * 0.9), rel=1e-12)
    assert PAPER.h2d_time(1000) == pytest.approx(327.68e6 / (128e9 * 0.9), rel=1e-12)
    assert PAPER.transfer_time(0) == 0.0 and PAPER.transfer_time(-5) == 0.0
    assert PAPER.h2d_time(-5) == 0.0


def test_out_of_range_cached_prefixes_are_clamped() -> None:
    n = 4096
    for fn in (PAPER.prefill_compute_time, PAPER.prefill_time):
        assert fn(n, -100) == fn(n, 0) == fn(n)
    overhead = 0.010
    assert PAPER.prefill_compute_time(n, n) == overhead
    assert PAPER.prefill_compute_time(n, n + 500) == overhead
    # fully cached: the pass is the larger of the overhead and loading the prefix
    assert PAPER.prefill_time(n, n) == max(overhead, PAPER.h2d_time(n))
    assert PAPER.prefill_time(n, n, cached_in_hbm=n) == overhead


def test_decode_step_by_hand() -> None:
    # memory-bound: (weights 141.2 GB + 10k tokens x 320 KiB) / (8 x 2039 GB/s x 0.7) + 3 ms
    mem = (141.2e9 + 10_000 * 327_680) / (8 * 2039e9 * 0.7)
    assert PAPER.decode_step_time(4, 10_000) == pytest.approx(0.003 + mem, rel=1e-12)
    assert PAPER.decode_step_time(0, 10_000) == 0.0


def test_model_flops_by_hand() -> None:
    # l * (a * n^2 * d + b * n * d^2) with l=2, a=4, b=22, d=8
    spec = ModelSpec(layers=2, d_model=8, flops_a=4.0, flops_b=22.0)
    assert spec.flops(3) == 2 * (4 * 9 * 8 + 22 * 3 * 64)
    assert spec.flops(0) == 0.0


def test_prefill_scale_multiplies_compute_and_overhead_exactly() -> None:
    cm = CostModel()
    base = [cm.prefill_compute_time(n, c) for n, c in ((1, 0), (4096, 0), (8192, 4096))]
    assert cm.version == 0 and cm.prefill_scale == 1.0
    cm.set_prefill_scale(2.0)
    assert cm.version == 1 and cm.prefill_scale == 2.0
    assert [cm.prefill_compute_time(n, c) for n, c in ((1, 0), (4096, 0), (8192, 4096))] == \
        pytest.approx([2 * t for t in base], rel=1e-12)
    cm.set_prefill_scale(0.5)
    assert cm.version == 2
    assert cm.prefill_compute_time(4096) == pytest.approx(base[1] / 2, rel=1e-12)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="positive"):
            cm.set_prefill_scale(bad)
    cm.set_prefill_scale(0.9)  # below 1 is fine
    assert cm.prefill_scale == 0.9


def test_fit_reports_relative_errors_and_validates_each_field() -> None:
    # a cubic the quadratic cannot follow exactly: known, nonzero relative errors
    samples = [(float(n), 0.0, 1.0 + (n / 1000.0) ** 3) for n in range(1000, 9000, 1000)]
    fit = fit_prefill_predictor(samples)
    errs = [abs(fit.predict(n, p) - t) / t for n, p, t in samples]
    assert fit.mean_abs_pct_error == pytest.approx(100 * sum(errs) / len(errs))
    assert fit.max_abs_pct_error == pytest.approx(100 * max(errs))
    assert fit.samples == len(samples)
    ok = [(float(n), 0.0, 1.0) for n in range(1, 7)]
    for bad in ((0.0, 0.0, 1.0), (10.0, -1.0, 1.0), (10.0, 11.0, 1.0), (10.0, 0.0, -1.0),
                (10.0, 0.0, math.inf), (10.0, 0.0, math.nan)):
        with pytest.raises(ValueError, match="bad sample"):
            fit_prefill_predictor([*ok, bad])
    fit_prefill_predictor([*ok, (1.0, 1.0, 0.0)])  # p == n and zero seconds are valid


def test_fit_of_too_few_distinct_lengths_is_singular() -> None:
    with pytest.raises(ValueError, match="singular"):
        fit_prefill_predictor([(1000.0, 0.0, 1.0)] * 6, ridge=0.0)
