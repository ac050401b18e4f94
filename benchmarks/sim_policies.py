"""Every policy on the paper-fig5 preset, over the bundled Mooncake conversation trace and
synthetic workloads of other shapes, side by side in one run.

    python benchmarks/sim_policies.py [--requests N] [--policies a,b,...] [--json OUT]

Prints, per workload, mean TTFT, SLO attainment and hit ratio of each policy and
the ratio of the best other policy's mean TTFT to ``conductor``'s (> 1.10 is the
goal), plus conductor's share of the workload's reuse ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from mooncake_conductor.engine import ConductorConfig
from mooncake_sim.cli import DEFAULT_COMPARE
from mooncake_sim.engine import SimConfig, simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.synth import SHAPES, generate
from mooncake_sim.trace import TraceRecord, bundled_trace, load_trace, trace_stats


def _run(job: tuple[list[TraceRecord], SimConfig]) -> dict[str, Any]:
    return simulate(*job)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000, help="requests per synthetic workload")
    ap.add_argument("--policies", default=DEFAULT_COMPARE)
    ap.add_argument("--workloads", default="mooncake-conversation," + ",".join(
        f"synth-{s}" for s in SHAPES))
    ap.add_argument("--utilization", type=float, default=None,
                    help="cold-prefill load to replay at (default: the preset's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    preset = PRESETS["paper-fig5"]
    policies = args.policies.split(",")
    report: dict[str, Any] = {}
    for wl in args.workloads.split(","):
        if wl == "mooncake-conversation":
            records = load_trace(bundled_trace())
        else:
            records = generate(wl.removeprefix("synth-"), args.requests, seed=11)
        stats = trace_stats(records)
        speed = speed_for_utilization(
            records, preset.prefill, args.utilization or preset.target_utilization)
        jobs = []
        for pol in policies:
            cfg = SimConfig(
                prefill=preset.prefill, decode=preset.decode, speed=speed,
                prefill_cache_tokens=preset.prefill_cache_tokens,
                conductor=ConductorConfig(policy=pol, slo={"ttft_s": preset.ttft_slo_s,
                                                           "tbt_s": preset.tbt_slo_ms / 1000}),
            )
            jobs.append((records, cfg))
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            results = list(pool.map(_run, jobs))
        by = {r["policy"]: r for r in results}
        print(f"\n== {wl}: {len(records)} requests, speed {speed:.2f}x, reuse ceiling "
              f"{100 * stats.reuse_ceiling_tokens:.1f}%")
        for r in results:
            print(f"  {r['policy']:20} TTFT {r['ttft_mean_s']:7.3f} s  SLO "
                  f"{100 * r['slo_attainment']:6.2f}%  hit {100 * r['token_hit_ratio']:5.1f}%  "
                  f"rejected {r['rejected']}")
        if "conductor" in by:
            c = by["conductor"]
            others = [r for r in results if r["policy"] != "conductor"]
            best = min(others, key=lambda r: r["ttft_mean_s"]) if others else None
            if best:
                top_slo = max(o["slo_attainment"] for o in others)
                cmp = ">=" if c["slo_attainment"] >= top_slo else "<"
                print(f"  best other: {best['policy']}, TTFT ratio "
                      f"{best['ttft_mean_s'] / c['ttft_mean_s']:.3f}x; conductor SLO {cmp} "
                      f"every other; hit {c['token_hit_ratio'] / stats.reuse_ceiling_tokens:.1%}"
                      " of ceiling")
        report[wl] = {"speed": speed, "reuse_ceiling": stats.reuse_ceiling_tokens,
                      "results": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
