"""Cost models: prefill, KV transfer, decode step (TBT) and queue time.

All parameters come from :class:`CostModelConfig`; the defaults are the Mooncake
paper's LLaMA3-70B on one 8xA800 node (Table 1, FAST'25) plus public A800 data
sheet figures for what the paper does not state (HBM bandwidth, achievable
efficiencies). Nothing here is fitted to a trace.

- Prefill FLOPs of n tokens: ``l * (a*n^2*d + b*n*d^2)`` (paper §3, Table 1).
  Reusing a cached prefix of p tokens saves ``flops(p)``, so a prefill with p
  cached tokens costs ``flops(n) - flops(p)``.
- Prefill time: those FLOPs over ``G * mfu(new_tokens)`` where the model FLOPs
  utilisation rises with the number of new tokens in the pass,
  ``mfu(x) = mfu_max * x / (x + mfu_half_tokens)`` (small passes are
  memory-bound), plus a fixed per-pass overhead. Loading the cached prefix
  from host memory (``p * kv_bytes_per_token / B_h2d``) overlaps with compute
  layer by layer (paper §4.1 layer-wise prefill), so the pass takes the larger
  of the two.
- KV transfer: bytes over the smaller of B_nic and B_h2d (paper §3).
- Decode step (continuous batching): memory-bound reading of all weights once
  plus every running sequence's KV, or compute-bound ``2*params*batch`` FLOPs,
  whichever is larger, plus a fixed per-step overhead. The TBT a request sees
  is the step time of the batch it is in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field


class ModelSpec(BaseModel):
    """Model shape (defaults: LLaMA3-70B, paper Table 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(80, gt=0, description="l")
    d_model: int = Field(8192, gt=0, description="d")
    flops_a: float = Field(4.0, ge=0, description="a: attention coefficient")
    flops_b: float = Field(22.0, ge=0, description="b: linear-layer coefficient")
    gqa: int = Field(8, gt=0, description="query heads per KV head")
    elem_bytes: int = Field(2, gt=0, description="s: bytes per element (bf16)")
    params: float = Field(70.6e9, gt=0, description="parameter count (decode weight reads)")

    @property
    def kv_bytes_per_token(self) -> int:
        """KVCache bytes of one token: ``l * 2*d/gqa * s`` (320 KiB for LLaMA3-70B)."""
        return int(self.layers * (2 * self.d_model // self.gqa) * self.elem_bytes)

    def flops(self, n: float) -> float:
        """Prefill FLOPs of an n-token prompt: ``l*(a*n^2*d + b*n*d^2)``."""
        d = float(self.d_model)
        return self.layers * (self.flops_a * n * n * d + self.flops_b * n * d * d)


class HardwareSpec(BaseModel):
    """One serving instance (defaults: one 8xA800 node, paper Table 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int = Field(8, gt=0)
    tflops_per_gpu: float = Field(312.0, gt=0, description="bf16 dense peak")
    hbm_gbps_per_gpu: float = Field(2039.0, gt=0, description="A800 80GB HBM2e, GB/s")
    hbm_gb_per_gpu: float = Field(80.0, gt=0)
    h2d_gbytes_per_s: float = Field(128.0, gt=0, description="B_h2d, GB/s")
    nic_gbits_per_s: float = Field(800.0, gt=0, description="B_nic, Gbit/s")

    @property
    def peak_flops(self) -> float:
        return self.gpus * self.tflops_per_gpu * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.gpus * self.hbm_gbps_per_gpu * 1e9

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbits_per_s * 1e9 / 8.0

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.h2d_gbytes_per_s * 1e9


class EfficiencySpec(BaseModel):
    """Achievable fractions of peak; typical published values for TP=8 on A100-class GPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mfu_max: float = Field(0.5, gt=0, le=1, description="prefill MFU for large passes")
    mfu_half_tokens: float = Field(
        256.0, ge=0, description="new tokens in a pass at which MFU reaches half of mfu_max"
    )
    prefill_overhead_s: float = Field(0.010, ge=0, description="fixed cost per prefill pass")
    hbm_efficiency: float = Field(0.7, gt=0, le=1, description="achieved / peak HBM bandwidth")
    decode_mfu: float = Field(0.4, gt=0, le=1, description="MFU when decode is compute-bound")
    decode_overhead_s: float = Field(0.003, ge=0, description="fixed cost per decode step")
    transfer_efficiency: float = Field(0.9, gt=0, le=1, description="achieved / link bandwidth")
    kv_hbm_fraction: float = Field(
        0.9, gt=0, le=1, description="share of HBM left after weights usable for KV"
    )


class CostModelConfig(BaseModel):
    """Everything the cost model needs; all defaults are the paper's setting."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec = ModelSpec()
    hardware: HardwareSpec = HardwareSpec()
    efficiency: EfficiencySpec = EfficiencySpec()


class CostModel:
    """Predicts prefill, transfer, decode-step and queue times from a :class:`CostModelConfig`."""

    def __init__(self, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        m, h, e = self.config.model, self.config.hardware, self.config.efficiency
        self.kv_bytes_per_token = m.kv_bytes_per_token
        self._peak = h.peak_flops
        self._mfu_max = e.mfu_max
        self._mfu_half = e.mfu_half_tokens
        self._prefill_overhead = e.prefill_overhead_s
        self._h2d = h.h2d_bytes_per_s * e.transfer_efficiency
        self._nic = h.nic_bytes_per_s * e.transfer_efficiency
        self._link = min(self._h2d, self._nic)
        self._hbm = h.hbm_bytes_per_s * e.hbm_efficiency
        self._weight_bytes = m.params * m.elem_bytes
        self._decode_flops_per_seq = 2.0 * m.params
        self._decode_peak = h.peak_flops * e.decode_mfu
        self._decode_overhead = e.decode_overhead_s
        # attention FLOPs per token of context in one decode step (QK^T and AV): 4*d per layer
        self._decode_attn_flops_per_ctx = 4.0 * m.layers * m.d_model
        self._flops_l_a_d = m.layers * m.flops_a * m.d_model
        self._flops_l_b_d2 = m.layers * m.flops_b * m.d_model * m.d_model
        kv_hbm = h.gpus * h.hbm_gb_per_gpu * 1e9 - self._weight_bytes
        self.kv_capacity_tokens = max(0, int(kv_hbm * e.kv_hbm_fraction / self.kv_bytes_per_token))
        #: multiplies every predicted prefill compute time (online calibration sets it)
        self.prefill_scale = 1.0
        #: multiplies every predicted decode step (decode calibration sets it)
        self.decode_scale = 1.0
        #: :meth:`decode_constants` as the compiled decode pricing takes them, kept current
        self.decode_array: npt.NDArray[np.float64] = np.array(self.decode_constants())
        #: bumped on every change of the constants, so cached copies know to refresh
        self.version = 0

    def set_prefill_scale(self, scale: float) -> None:
        """Predict prefill compute ``scale`` x slower than the configured model: the peak
        FLOPs divided and the fixed overhead multiplied by it (the shape, MFU curve and
        the host-to-device load time stay as configured)."""
        if not scale > 0:
            raise ValueError("scale must be positive")
        e, h = self.config.efficiency, self.config.hardware
        self.prefill_scale = scale
        self._peak = h.peak_flops / scale
        self._prefill_overhead = e.prefill_overhead_s * scale
        self.version += 1

    def set_decode_scale(self, scale: float) -> None:
        """Predict every decode step ``scale`` x slower than the configured model: HBM
        bandwidth and decode FLOPs divided, the fixed overhead multiplied by it (both arms
        of the step scale alike, so the instances' order by step does not change)."""
        if not scale > 0:
            raise ValueError("scale must be positive")
        h, e = self.config.hardware, self.config.efficiency
        self.decode_scale = scale
        self._hbm = h.hbm_bytes_per_s * e.hbm_efficiency / scale
        self._decode_peak = h.peak_flops * e.decode_mfu / scale
        self._decode_overhead = e.decode_overhead_s * scale
        self.decode_array = np.array(self.decode_constants())
        self.version += 1

    # -- prefill -----------------------------------------------------------------------------
    def flops(self, n: float) -> float:
        return self._flops_l_a_d * n * n + self._flops_l_b_d2 * n

    def mfu(self, new_tokens: float) -> float:
        if new_tokens <= 0:
            return self._mfu_max
        return self._mfu_max * new_tokens / (new_tokens + self._mfu_half)

    @property
    def prefill_overhead_s(self) -> float:
        """The fixed cost of one prefill pass (scaled with the calibrated speed)."""
        return self._prefill_overhead

    def prefill_flops_rate(self, new_tokens: float) -> float:
        """FLOP/s of a prefill pass computing ``new_tokens`` (peak x MFU)."""
        return self._peak * self.mfu(new_tokens)

    def prefill_compute_time(self, n: int, cached: int = 0) -> float:
        """Seconds of GPU compute to prefill ``n`` tokens of which ``cached`` are reused."""
        cached = min(max(cached, 0), n)
        new = n - cached
        if new <= 0:
            return self._prefill_overhead
        work = self.flops(n) - self.flops(cached)
        return self._prefill_overhead + work / (self._peak * self.mfu(new))

    def prefill_time(self, n: int, cached: int = 0, cached_in_hbm: int = 0) -> float:
        """Prefill wall time: compute overlapped layer-wise with loading the cached prefix
        from host memory (tokens already in HBM load for free)."""
        # prefill_compute_time inlined (the same arithmetic): this runs several times
        # per scheduling decision
        reused = min(max(cached, 0), n)
        new = n - reused
        if new <= 0:
            compute = self._prefill_overhead
        else:
            a, b = self._flops_l_a_d, self._flops_l_b_d2
            work = (a * n * n + b * n) - (a * reused * reused + b * reused)
            mfu = self._mfu_max * new / (new + self._mfu_half)
            compute = self._prefill_overhead + work / (self._peak * mfu)
        load = max(0, cached - cached_in_hbm) * self.kv_bytes_per_token / self._h2d
        return compute if compute >= load else load

    def prefill_constants(self) -> list[float]:
        """The constants :func:`~mooncake_conductor.scoring_kernel.rank_fifo` prices prefills and
        transfers with, in the order of :data:`~mooncake_conductor.scoring_kernel.COST_FIELDS`."""
        return [self._flops_l_a_d, self._flops_l_b_d2, self._prefill_overhead, self._mfu_max,
                self._mfu_half, self._peak, float(self.kv_bytes_per_token), self._h2d,
                self._link]

    def reuse_breakeven_bandwidth(self, prefix_tokens: int) -> float:
        """Bytes/s above which loading a cached prefix beats recomputing it (paper §3:
        reuse pays when ``B/G > 2*d*s / (gqa*(a*p*d + b*d^2))``)."""
        m = self.config.model
        d, p = float(m.d_model), float(prefix_tokens)
        ratio = 2 * d * m.elem_bytes / (m.gqa * (m.flops_a * p * d + m.flops_b * d * d))
        return ratio * self.config.hardware.peak_flops

    # -- transfer ----------------------------------------------------------------------------
    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    @property
    def link_bytes_per_s(self) -> float:
        """The achieved bytes per second of a transfer between two nodes: min(B_nic, B_h2d)
        times the transfer efficiency (what :meth:`transfer_time` divides by)."""
        return self._link

    def transfer_time(self, tokens: int) -> float:
        """Seconds to move the KV of ``tokens`` between nodes: min(B_nic, B_h2d) (paper §3)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / self._link

    def h2d_time(self, tokens: int) -> float:
        return max(0, tokens) * self.kv_bytes_per_token / self._h2d

    # -- decode ------------------------------------------------------------------------------
    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        """One continuous-batching decode iteration with ``batch`` sequences holding
        ``context_tokens`` tokens of KV in total: the larger of reading weights plus KV
        from HBM and the batch's FLOPs, plus a fixed overhead."""
        if batch <= 0:
            return 0.0
        mem = (self._weight_bytes + context_tokens * self.kv_bytes_per_token) / self._hbm
        compute = (
            batch * self._decode_flops_per_seq + context_tokens * self._decode_attn_flops_per_ctx
        ) / self._decode_peak
        return self._decode_overhead + max(mem, compute)

    def decode_constants(self) -> list[float]:
        """The constants :func:`~mooncake_conductor.decode_kernel.rank_decode` prices decode
        steps with, in the order of :data:`~mooncake_conductor.decode_kernel.DECODE_FIELDS`."""
        return [float(self._weight_bytes), float(self.kv_bytes_per_token), self._hbm,
                self._decode_flops_per_seq, self._decode_attn_flops_per_ctx,
                self._decode_peak, self._decode_overhead]

    # -- queue -------------------------------------------------------------------------------
    @staticmethod
    def queue_time(predicted_work_s: Sequence[float], running_remaining_s: float = 0.0) -> float:
        """Time until a new arrival starts: what is running plus everything queued ahead."""
        return max(0.0, running_remaining_s) + sum(max(0.0, w) for w in predicted_work_s)


# -- the paper's prefill-time predictor -------------------------------------------------------

#: token counts as a sample gives them (whole tokens, or floats for the regression)
_Length = TypeVar("_Length", int, float)

FEATURE_NAMES: tuple[str, ...] = ("1", "n", "p", "n^2", "p^2", "n*p")


def _features(n: float, p: float) -> list[float]:
    return [1.0, n, p, n * n, p * p, n * p]


class PrefillPredictor(BaseModel):
    """Polynomial regression of prefill seconds on (prompt length n, cached prefix p), the
    predictor the paper's scheduler uses (§4, "fitted on offline measurements")."""

    model_config = ConfigDict(frozen=True)

    coefficients: tuple[float, ...]
    scale: float = 1.0
    mean_abs_pct_error: float = 0.0
    max_abs_pct_error: float = 0.0
    samples: int = 0

    def predict(self, n: float, p: float = 0.0) -> float:
        x = _features(n / self.scale, p / self.scale)
        return max(0.0, sum(c * v for c, v in zip(self.coefficients, x, strict=True)))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small dense systems only)."""
    size = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("singular system: samples do not determine the polynomial")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(size):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for c in range(col, size + 1):
                        m[r][c] -= f * m[col][c]
    return [m[i][size] / m[i][i] for i in range(size)]


def prediction_errors(
    predict: Callable[[_Length, _Length], float], samples: Sequence[tuple[_Length, _Length, float]]
) -> tuple[float, float]:
    """Mean and largest absolute error, in percent of the measured value, of ``predict(n,
    p)`` over measured ``(n, p, seconds)`` samples."""
    errs = [abs(predict(n, p) - t) / t for n, p, t in samples if t > 0]
    if not errs:
        raise ValueError("no sample with a positive time")
    return 100.0 * sum(errs) / len(errs), 100.0 * max(errs)


def fit_prefill_predictor(
    samples: Sequence[tuple[float, float, float]], ridge: float = 1e-9
) -> PrefillPredictor:
    """Least-squares fit of seconds ~ poly2(n, p) to measured ``(n, p, seconds)`` samples.

    Lengths are scaled to thousands of tokens so the normal equations stay well
    conditioned; the reported errors are relative to each measured value.
    """
    if len(samples) < len(FEATURE_NAMES):
        raise ValueError(f"need at least {len(FEATURE_NAMES)} samples, got {len(samples)}")
    for n, p, t in samples:
        if n <= 0 or p < 0 or p > n or t < 0 or not math.isfinite(t):
            raise ValueError(f"bad sample (n={n}, p={p}, seconds={t})")
    scale = 1000.0
    k = len(FEATURE_NAMES)
    ata = [[0.0] * k for _ in range(k)]
    atb = [0.0] * k
    for n, p, t in samples:
        x = _features(n / scale, p / scale)
        for i in range(k):
            atb[i] += x[i] * t
            for j in range(k):
                ata[i][j] += x[i] * x[j]
    for i in range(k):
        ata[i][i] += ridge
    coef = _solve(ata, atb)
    pred = PrefillPredictor(coefficients=tuple(coef), scale=scale)
    mean, worst = (prediction_errors(pred.predict, samples) if any(t > 0 for _, _, t in samples)
                   else (0.0, 0.0))
    return PrefillPredictor(
        coefficients=tuple(coef),
        scale=scale,
        mean_abs_pct_error=mean,
        max_abs_pct_error=worst,
        samples=len(samples),
    )


# -- calibrating the prefill formula against measurements -------------------------------------

#: attention coefficients ``a`` the efficiency fit tries (4: the paper's count, attention
#: over the whole square; 2: causal kernels skip the masked half)
FIT_FLOPS_A: tuple[float, ...] = tuple(0.25 * i for i in range(1, 25))
#: half-efficiency pass sizes (new tokens) the efficiency fit tries
FIT_HALF_TOKENS: tuple[float, ...] = tuple(float(16 * i) for i in range(0, 129))


class EfficiencyFit(BaseModel):
    """The prefill formula's free terms fitted to measurements, and how well it then fits.
    ``flops_a``, ``mfu_max``, ``mfu_half_tokens`` and ``prefill_overhead_s`` go into
    :class:`ModelSpec` and :class:`EfficiencySpec` as they are."""

    model_config = ConfigDict(frozen=True)

    flops_a: float
    mfu_max: float
    mfu_half_tokens: float
    prefill_overhead_s: float
    mean_abs_pct_error: float
    max_abs_pct_error: float
    samples: int

    def applied_to(self, config: CostModelConfig) -> CostModelConfig:
        """``config`` with the fitted terms in place of its own."""
        return config.model_copy(update={
            "model": config.model.model_copy(update={"flops_a": self.flops_a}),
            "efficiency": config.efficiency.model_copy(update={
                "mfu_max": self.mfu_max, "mfu_half_tokens": self.mfu_half_tokens,
                "prefill_overhead_s": self.prefill_overhead_s}),
        })


def fit_prefill_efficiency(
    samples: Sequence[tuple[int, int, float]],
    config: CostModelConfig,
    flops_a: Sequence[float] = FIT_FLOPS_A,
    half_tokens: Sequence[float] = FIT_HALF_TOKENS,
) -> EfficiencyFit:
    """Fit the cost model's prefill compute formula to measured ``(n, p, seconds)``
    samples (``n`` prompt tokens, ``p`` of them cached), keeping the model's shape
    (``l``, ``d``, ``b``) and peak ``G`` from ``config``.

    The formula ``t = overhead + l*(a*(n^2 - p^2)*d + b*(n - p)*d^2) * (x + h) / (x*G*mfu_max)``
    (``x = n - p``) is linear in ``overhead`` and ``1/mfu_max`` once ``a`` and ``h`` are
    fixed, so each pair from the two grids is solved by least squares on the relative
    error (every sample weighs the same whatever its length) and the pair with the
    smallest mean relative error is kept."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 samples, got {len(samples)}")
    for n, p, t in samples:
        if n <= 0 or p < 0 or p >= n or not (t > 0 and math.isfinite(t)):
            raise ValueError(f"bad sample (n={n}, p={p}, seconds={t}): need 0 <= p < n, t > 0")
    m, g = config.model, config.hardware.peak_flops
    d = float(m.d_model)
    best: EfficiencyFit | None = None
    for a in flops_a:
        for h in half_tokens:
            # rows divided by t: minimise sum ((c0 + c1*w)/t - 1)^2
            s00 = s01 = s11 = r0 = r1 = 0.0
            ws = []
            for n, p, t in samples:
                x = n - p
                w = m.layers * (a * (n * n - p * p) * d + m.flops_b * x * d * d) * (x + h) / (x * g)
                ws.append(w)
                u, v = 1.0 / t, w / t
                s00 += u * u
                s01 += u * v
                s11 += v * v
                r0 += u
                r1 += v
            det = s00 * s11 - s01 * s01
            if det <= 0:
                continue
            c0 = (r0 * s11 - r1 * s01) / det
            c1 = (s00 * r1 - s01 * r0) / det
            if c0 < 0:  # no negative overhead: refit through the origin
                c0, c1 = 0.0, r1 / s11
            if c1 <= 1.0:  # mfu_max would reach 1 or more
                continue
            errs = [abs(c0 + c1 * w - t) / t for w, (_, _, t) in zip(ws, samples, strict=True)]
            mean = 100.0 * sum(errs) / len(errs)
            if best is None or mean < best.mean_abs_pct_error:
                best = EfficiencyFit(
                    flops_a=a, mfu_max=1.0 / c1, mfu_half_tokens=h, prefill_overhead_s=c0,
                    mean_abs_pct_error=mean, max_abs_pct_error=100.0 * max(errs),
                    samples=len(samples))
    if best is None:
        raise ValueError("no efficiency in (0, 1] fits these samples at this peak")
    return best
