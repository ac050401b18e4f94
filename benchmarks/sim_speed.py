"""How fast the simulator replays the whole Mooncake conversation trace.

    python benchmarks/sim_speed.py [--policies conductor,random] [--repeat 1]

One policy at a time over all 12,031 requests at 16 prefill + 16 decode
instances (the paper-fig5 preset). Prints wall seconds and simulated requests
per second for each policy side by side; ``random`` does no cache lookups and
is the floor the event loop itself costs. The issue's bar: one policy under
30 s on this machine.
"""

from __future__ import annotations

import argparse
import time

from mooncake_conductor.engine import ConductorConfig
from mooncake_sim.engine import SimConfig, simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.trace import bundled_trace, load_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="conductor,kvcache-centric,random")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    records = load_trace(bundled_trace())
    load_s = time.perf_counter() - t0
    preset = PRESETS["paper-fig5"]
    speed = speed_for_utilization(records, preset.prefill, preset.target_utilization)
    print(f"trace load + validation: {load_s:.2f} s for {len(records)} requests")
    rows = []
    for policy in args.policies.split(","):
        best = float("inf")
        for _ in range(args.repeat):
            cfg = SimConfig(prefill=16, decode=16, speed=speed,
                            prefill_cache_tokens=preset.prefill_cache_tokens,
                            conductor=ConductorConfig(policy=policy))
            t = time.perf_counter()
            simulate(records, cfg)
            best = min(best, time.perf_counter() - t)
        rows.append((policy, best))
    floor = next((w for p, w in rows if p == "random"), None)
    print(f"{'policy':18} {'wall s':>8} {'requests/s':>11} {'vs random':>10}")
    for policy, wall in rows:
        ratio = f"{wall / floor:.2f}x" if floor else "-"
        print(f"{policy:18} {wall:8.2f} {len(records) / wall:11,.0f} {ratio:>10}")


if __name__ == "__main__":
    main()
