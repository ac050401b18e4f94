"""What pricing candidates instead of the whole pool costs in TTFT, in the simulator.

    python benchmarks/candidates_sim.py [--requests 3000] [--loads 0.8,1.1]
        [--sizes 16,32] [--k 4,8] [--jobs 2] [--json OUT.json]

Every published simulation runs on pools below ``candidates.min_pool`` (128 instances),
where the full pass decides; this forces candidates on (``min_pool`` 2) so that their
effect shows on the workloads of the scheduling tables: the bundled conversation trace
and the paper's three synthetic shapes, at each load (a share of the pool's cold-prefill
capacity) and pool size (prefill instances, as many decode), with the paper-fig5
preset's realism (prediction error, NIC contention, event lag). Variants: ``conductor``
with candidates off (the full pass), the same with another seed for its random draws
(``full-s2``: how much a different trajectory alone moves the numbers), and with
``least_loaded = holders = k`` for each ``k`` of ``--k`` (with 16 instances and k 4, a
decision prices at most 8 of 16 prefill instances and 4 of 16 decode). Reported per
setting: charged mean TTFT (rejected requests charged the TTFT SLO) as a ratio to the
full pass's, SLO attainment and rejected share for each, and at the end the geometric
mean and the worst ratio per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from mooncake_sim.engine import SimConfig, simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.synth import PAPER_SHAPES, generate
from mooncake_sim.trace import TraceRecord, bundled_trace, load_trace

PRESET = PRESETS["paper-fig5"]
SYNTH_SEED = 11  # the scheduling tables' synthetic workloads


def _workloads(requests: int) -> dict[str, list[TraceRecord]]:
    out = {"conversation": load_trace(bundled_trace())}
    for shape in PAPER_SHAPES:
        out[f"synth-{shape}"] = generate(shape, requests, seed=SYNTH_SEED)
    return out


def _run(job: tuple[str, list[TraceRecord], SimConfig]) -> tuple[str, dict[str, Any]]:
    key, records, cfg = job
    return key, simulate(records, cfg)


def _csv(kind: type, text: str) -> list[Any]:
    return [kind(x) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--loads", default="0.8,1.1")
    ap.add_argument("--sizes", default="16,32")
    ap.add_argument("--k", default="4,8")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    loads, sizes, ks = _csv(float, a.loads), _csv(int, a.sizes), _csv(int, a.k)
    data = _workloads(a.requests)
    # (ConductorConfig fields) the full pass; the full pass with other random draws (the
    # noise a different trajectory makes); candidates at each k
    variants: dict[str, dict[str, Any]] = {
        "full": {"candidates": {"enabled": False}},
        "full-s2": {"candidates": {"enabled": False}, "seed": 2}}
    for k in ks:
        variants[f"k{k}"] = {"candidates": {"min_pool": 2, "least_loaded": k, "holders": k}}
    jobs = []
    for size in sizes:
        for name, recs in data.items():
            for load in loads:
                speed = speed_for_utilization(recs, size, load)
                for var, cond in variants.items():
                    cfg = PRESET.sim_config("conductor", speed, prefill=size, decode=size,
                                            conductor=cond)
                    jobs.append((f"{size}|{name}|{load}|{var}", recs, cfg))
    started = time.perf_counter()
    res: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        futures = [pool.submit(_run, j) for j in jobs]
        for fut in as_completed(futures):
            key, r = fut.result()
            res[key] = r
            print(f"[{len(res)}/{len(jobs)}] {key} ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    rows = []
    print(f"{'pool':>4} {'workload':18} {'load':>4} {'variant':7} {'TTFT s':>8} "
          f"{'vs full':>8} {'SLO met':>8} {'rejected':>8}")
    for size in sizes:
        for name in data:
            for load in loads:
                full = res[f"{size}|{name}|{load}|full"]
                for var in variants:
                    r = res[f"{size}|{name}|{load}|{var}"]
                    ratio = r["ttft_mean_charged_s"] / full["ttft_mean_charged_s"]
                    rows.append({"prefill": size, "workload": name, "load": load,
                                 "variant": var, "ttft_mean_charged_s":
                                 r["ttft_mean_charged_s"], "ratio_to_full": ratio,
                                 "slo_attainment": r["slo_attainment"],
                                 "rejected": r["rejected"]})
                    print(f"{size:4d} {name:18} {load:4.1f} {var:7} "
                          f"{r['ttft_mean_charged_s']:8.3f} {ratio:8.3f} "
                          f"{100 * r['slo_attainment']:7.1f}% {r['rejected']:8d}")
    print("\nsummary: charged mean TTFT with candidates / full pass (> 1: slower)")
    for var in variants:
        if var == "full":
            continue
        ratios = [r["ratio_to_full"] for r in rows if r["variant"] == var]
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"  {var}: geometric mean {geo:.4f}, best {min(ratios):.4f}, "
              f"worst {max(ratios):.4f} over {len(ratios)} settings")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"requests": a.requests, "loads": loads, "sizes": sizes, "k": ks,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
