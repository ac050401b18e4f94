"""Compare the cost model with prefill and decode times measured on a real GPU.

    python benchmarks/gpu_calibration_report.py \\
        [--samples docs/results/gpu-calibration-h200.json] \\
        [--eager docs/results/gpu-calibration-h200-eager.json] \\
        [--markdown docs/results/gpu-calibration.md]

The samples come from ``benchmarks/gpu_prefill_calibration.py`` (one tensor-parallel
rank of a LLaMA3-70B layer on the GPU, times the layer count). The cost model is set to
that node's data-sheet figures (``--tflops-per-gpu``, ``--hbm-gbps-per-gpu``, default
H200: 989 dense bf16 TFLOP/s, 4,800 GB/s) and otherwise keeps its defaults (the paper's
model, the efficiency assumptions of ``docs/cost-model.md``). Reported side by side:

- the default formula's error at that peak;
- the formula with its free terms fitted (``fit_prefill_efficiency``: attention
  coefficient ``a``, ``mfu_max``, ``mfu_half_tokens``, per-pass overhead), and with ``a``
  held at the paper's 4;
- the paper's own predictor (a quadratic in prompt and prefix length, fitted);
- decode steps against ``decode_step_time``;
- a long prompt prefilled chunk by chunk (what a CPP stage computes) against one pass;
- with ``--eager``: what kernel launches add when passes are not replayed as CUDA graphs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mooncake_conductor.cost import (
    CostModel,
    CostModelConfig,
    HardwareSpec,
    ModelSpec,
    fit_prefill_efficiency,
    fit_prefill_predictor,
    prediction_errors,
)

ROOT = Path(__file__).resolve().parent.parent


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def prefill_samples(data: dict[str, Any]) -> list[tuple[int, int, float]]:
    """``(prompt tokens, cached prefix, node seconds)`` per measured pass."""
    return [(s["new"] + s["prefix"], s["prefix"], s["compute_s"]) for s in data["samples"]]


def node_config(data: dict[str, Any], tflops: float, hbm_gbps: float,
                hbm_gb: float) -> CostModelConfig:
    m = data["model"]
    return CostModelConfig(
        model=ModelSpec(layers=m["layers"], d_model=m["d_model"],
                        gqa=m["heads"] // m["kv_heads"]),
        hardware=HardwareSpec(gpus=data["hardware"]["tp"], tflops_per_gpu=tflops,
                              hbm_gbps_per_gpu=hbm_gbps, hbm_gb_per_gpu=hbm_gb),
    )


def cost_yaml(fitted: CostModelConfig) -> list[str]:
    """``conductor.cost`` lines: every field of ``fitted`` that differs from the defaults,
    two-space indented YAML."""
    default = CostModelConfig().model_dump()
    lines = ["cost:"]
    for section, values in fitted.model_dump().items():
        changed = {k: v for k, v in values.items() if v != default[section][k]}
        if changed:
            lines.append(f"  {section}:")
            lines += [f"    {k}: {float(f'{v:.6g}') if isinstance(v, float) else v}"
                      for k, v in changed.items()]
    return lines


def report(args: argparse.Namespace) -> str:
    data = load(args.samples)
    samples = prefill_samples(data)
    cfg = node_config(data, args.tflops_per_gpu, args.hbm_gbps_per_gpu, args.hbm_gb_per_gpu)
    default = CostModel(cfg)
    hw = data["hardware"]
    lines = [
        "# The cost model against a real GPU",
        "",
        f"Measured by `benchmarks/gpu_prefill_calibration.py` on one {hw['gpu']} "
        f"(torch {hw['torch']}; an 8192-cubed bf16 matrix product ran at "
        f"{hw['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s): {data['method']}. "
        f"Node time = layer time x {data['model']['layers']} layers; the node is "
        f"{hw['tp']} such GPUs at TP={hw['tp']}, modelled with the data sheet's "
        f"{args.tflops_per_gpu:g} TFLOP/s and {args.hbm_gbps_per_gpu:g} GB/s per GPU. "
        "Compared by `benchmarks/gpu_calibration_report.py`. "
        "Errors are relative to the measured time.",
        "",
        "## Prefill",
        "",
    ]
    fit = fit_prefill_efficiency(samples, cfg)
    fit4 = fit_prefill_efficiency(samples, cfg, flops_a=(cfg.model.flops_a,))
    poly = fit_prefill_predictor(samples)
    fitted = CostModel(fit.applied_to(cfg))
    e = cfg.efficiency
    # what online calibration learns: one factor on the whole compute time (least squares
    # on the relative error)
    ratios = [default.prefill_compute_time(n, p) / t for n, p, t in samples]
    scale = sum(ratios) / sum(r * r for r in ratios)
    scaled = CostModel(cfg)
    scaled.set_prefill_scale(scale)
    rows = [
        ("defaults (paper's a, assumed efficiency)", cfg.model.flops_a, e.mfu_max,
         e.mfu_half_tokens, e.prefill_overhead_s,
         *prediction_errors(default.prefill_compute_time, samples)),
        (f"defaults x {scale:.3f} (one factor, what online calibration learns)",
         cfg.model.flops_a, e.mfu_max / scale, e.mfu_half_tokens, e.prefill_overhead_s * scale,
         *prediction_errors(scaled.prefill_compute_time, samples)),
        (f"efficiency fitted, a held at {cfg.model.flops_a:g}", fit4.flops_a, fit4.mfu_max,
         fit4.mfu_half_tokens, fit4.prefill_overhead_s, fit4.mean_abs_pct_error,
         fit4.max_abs_pct_error),
        ("efficiency and a fitted", fit.flops_a, fit.mfu_max, fit.mfu_half_tokens,
         fit.prefill_overhead_s, fit.mean_abs_pct_error, fit.max_abs_pct_error),
    ]
    lines += [
        f"{len(samples)} passes: 64 to 131,072 new tokens, cached prefixes of 0 to 98,304.",
        "",
        "| formula | a | mfu_max | mfu_half_tokens | overhead s | mean error | max error |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(f"| {name} | {a:g} | {mx:.3f} | {h:g} | {o:.4f} | {me:.1f}% | {xe:.1f}% |"
          for name, a, mx, h, o, me, xe in rows),
        f"| the paper's predictor (quadratic in n and p, fitted) | | | | | "
        f"{poly.mean_abs_pct_error:.1f}% | {poly.max_abs_pct_error:.1f}% |",
        "",
        "| new tokens | prefix | measured s | defaults s | fitted s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, p, t in samples:
        lines.append(f"| {n - p:,} | {p:,} | {t:.4f} | {default.prefill_compute_time(n, p):.4f} "
                     f"| {fitted.prefill_compute_time(n, p):.4f} |")
    if data.get("chunked_samples"):
        single = {s["new"]: s["compute_s"] for s in data["samples"] if s["prefix"] == 0}
        lines += [
            "",
            "### One prompt, chunk by chunk",
            "",
            "What a chunked-pipeline (CPP) stage computes: the prompt in chunks, each a pass "
            "over the chunks before it; summed here (a group of `X` stages takes `1/X` of "
            "each and adds the pipeline's fill and drain). Against the same prompt in one "
            "pass:",
            "",
            "| prompt | chunk | passes | measured s | / one pass | defaults s | / one pass "
            "| fitted s | / one pass |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in data["chunked_samples"]:
            n, ch = c["prompt"], c["chunk"]
            row = [f"| {n:,} | {ch:,} | {c['passes']} | {c['compute_s']:.2f} | "
                   + (f"{c['compute_s'] / single[n]:.2f}" if n in single else "")]
            for cm in (default, fitted):
                total = sum(cm.prefill_compute_time(min(s + ch, n), s) for s in range(0, n, ch))
                row.append(f"{total:.2f} | {total / cm.prefill_compute_time(n):.2f}")
            lines.append(" | ".join(row) + " |")
    lines += [
        "",
        "The fitted terms as the gateway's `conductor.cost` for this node (a model's entry "
        "in its `--config`; the shape and the rest as the defaults):",
        "",
        "```yaml",
        *cost_yaml(fitted.config),
        "```",
    ]
    if data.get("decode_samples"):
        lines += [
            "",
            "## Decode",
            "",
            "Every sequence of the batch holds `context` tokens; the model's step is "
            "`decode_step_time(batch, batch x context)` at its defaults (HBM efficiency "
            f"{e.hbm_efficiency:g}, decode MFU {e.decode_mfu:g}, {e.decode_overhead_s * 1e3:g} ms "
            "per step).",
            "",
            "| batch | context | measured ms | model ms | model / measured |",
            "|---:|---:|---:|---:|---:|",
        ]
        for s in data["decode_samples"]:
            model = default.decode_step_time(s["batch"], s["batch"] * s["context"])
            lines.append(f"| {s['batch']} | {s['context']:,} | {s['step_s'] * 1e3:.2f} | "
                         f"{model * 1e3:.2f} | {model / s['step_s']:.2f} |")
    if args.eager is not None:
        eager = {(s["new"], s["prefix"]): s["compute_s"] for s in load(args.eager)["samples"]}
        lines += [
            "",
            "## Kernel launches",
            "",
            "The same passes run eagerly (one launch per kernel, as a prefill that is not "
            "replayed as a CUDA graph runs):",
            "",
            "| new tokens | prefix | CUDA graph s | eager s | eager adds |",
            "|---:|---:|---:|---:|---:|",
        ]
        for s in data["samples"]:
            key = (s["new"], s["prefix"])
            if key in eager and s["new"] <= 4096 and s["prefix"] in (0, 32768):
                lines.append(f"| {s['new']:,} | {s['prefix']:,} | {s['compute_s']:.4f} | "
                             f"{eager[key]:.4f} | {eager[key] - s['compute_s']:.4f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=Path,
                    default=ROOT / "docs/results/gpu-calibration-h200.json")
    ap.add_argument("--eager", type=Path, default=None,
                    help="the same sweep without CUDA graphs (--no-graphs)")
    ap.add_argument("--tflops-per-gpu", type=float, default=989.0,
                    help="data-sheet dense bf16 TFLOP/s of the GPU measured (H200: 989)")
    ap.add_argument("--hbm-gbps-per-gpu", type=float, default=4800.0,
                    help="data-sheet HBM bandwidth, GB/s (H200: 4,800)")
    ap.add_argument("--hbm-gb-per-gpu", type=float, default=141.0, help="H200: 141")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    try:
        text = report(args)
    except OSError as exc:
        ap.error(f"cannot read the samples: {exc}")
    except (ValueError, KeyError, TypeError) as exc:  # JSON, missing fields, bad samples
        ap.error(f"not a sample file of gpu_prefill_calibration.py: {exc!r}")
    print(text, end="")
    if args.markdown is not None:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
