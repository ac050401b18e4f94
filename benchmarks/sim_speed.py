"""How fast the simulator replays the whole Mooncake conversation trace.

    python benchmarks/sim_speed.py [--policies conductor,random] [--repeat 1]

One policy at a time over all 12,031 requests with the paper-fig5 preset as
``simulate --preset paper-fig5`` runs it: 16 prefill + 16 decode instances, its
SLOs and its realism (prediction error, KV-event lag, NIC contention), which change
what the policies decide and so what a replay costs. Prints wall seconds (the fastest
of ``--repeat`` runs, the policies taking turns) and simulated requests per second
side by side; ``random`` does no cache lookups and is the floor the event loop itself
costs. Start-up is not included: ``benchmarks/scheduling_results.py`` (section
``speed``) times whole fresh processes.
"""

from __future__ import annotations

import argparse
import time

from mooncake_conductor.policies import policy_names
from mooncake_sim.engine import simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.trace import bundled_trace, load_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="conductor,kvcache-centric,random")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in policy_names()]
    if unknown:
        ap.error(f"--policies: unknown policy {', '.join(unknown)}; "
                 f"known: {', '.join(policy_names())}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, not {args.repeat}")
    t0 = time.perf_counter()
    records = load_trace(bundled_trace())
    load_s = time.perf_counter() - t0
    preset = PRESETS["paper-fig5"]
    speed = speed_for_utilization(records, preset.prefill, preset.target_utilization)
    print(f"trace load + validation: {load_s:.2f} s for {len(records)} requests")
    best = dict.fromkeys(policies, float("inf"))
    for _ in range(args.repeat):
        for policy in policies:  # in turns: a slow spell of the host hits every policy
            cfg = preset.sim_config(policy, speed)
            t = time.perf_counter()
            simulate(records, cfg)
            best[policy] = min(best[policy], time.perf_counter() - t)
    rows = list(best.items())
    floor = next((w for p, w in rows if p == "random"), None)
    print(f"{'policy':18} {'wall s':>8} {'requests/s':>11} {'vs random':>10}")
    for policy, wall in rows:
        ratio = f"{wall / floor:.2f}x" if floor else "-"
        print(f"{policy:18} {wall:8.2f} {len(records) / wall:11,.0f} {ratio:>10}")


if __name__ == "__main__":
    main()
