"""One capacity search on one process against the same search probing several speeds a round.

    python benchmarks/capacity_parallel.py [--policy conductor] [--jobs 2] [--repeats 2]
        [--trace FILE] [--json OUT.json]

``mooncake-operator capacity`` runs each search in a thread of its own and its replays on a
pool of ``--jobs`` processes; with fewer searches than processes, a search probes
``jobs // searches`` speeds a round (``search_capacity_batched``). This runs the paper-fig5
capacity search of one policy with ``--jobs 1`` and with ``--jobs N`` side by side, in
fresh processes, in ABBA order (so a drift of the machine's speed over the run falls on
both alike), and reports wall seconds, rounds, probes and the capacity each found, and the
ratio of the wall times. The two searches probe different speeds, so their capacities
differ by up to the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run_once(policy: str, jobs: int, trace: str | None) -> dict[str, Any]:
    """One ``capacity`` run in a fresh process: wall seconds and its JSON row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cap.json"
        cmd = [sys.executable, "-m", "mooncake_cli", "capacity", "--preset", "paper-fig5",
               "--policy", policy, "--jobs", str(jobs), "--json", str(out)]
        if trace:
            cmd += ["--trace", trace]
        started = time.perf_counter()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - started
        if done.returncode:  # bad input (policy, trace): the CLI's own message, no traceback
            sys.exit(f"capacity_parallel: `{' '.join(cmd[2:])}` failed: "
                     + (done.stderr.strip().splitlines() or ["no message"])[-1])
        row = json.loads(out.read_text())["results"][0]
    return {"jobs": jobs, "wall_s": wall, "capacity_speed": row["capacity_speed"],
            "probes": len(row["probes"]), "rounds": row["rounds"],
            "probes_per_round": row["probes_per_round"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="conductor")
    ap.add_argument("--jobs", type=int, default=max(2, os.cpu_count() or 1))
    ap.add_argument("--repeats", type=int, default=2, help="runs of each, in ABBA order")
    ap.add_argument("--trace", default=None, help="trace file (default: the bundled one)")
    ap.add_argument("--json", default=None, help="write every run as JSON")
    args = ap.parse_args()
    if args.jobs < 2 or args.repeats < 1:
        ap.error("--jobs must be at least 2 and --repeats at least 1")
    order = []
    for i in range(args.repeats):
        order += [1, args.jobs] if i % 2 == 0 else [args.jobs, 1]
    runs: list[dict[str, Any]] = []
    for n, jobs in enumerate(order, 1):
        r = run_once(args.policy, jobs, args.trace)
        runs.append(r)
        print(f"[{n}/{len(order)}] --jobs {jobs}: {r['wall_s']:.1f} s, {r['rounds']} rounds, "
              f"{r['probes']} probes, capacity {r['capacity_speed']:.4g}x",
              file=sys.stderr, flush=True)
    print(f"\ncapacity search, {args.policy}, paper-fig5 ({os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f})")
    print(f"{'jobs':>5} {'wall s (each run)':>28} {'mean':>7} {'rounds':>7} {'probes':>7} "
          f"{'capacity':>9}")
    means = {}
    for jobs in (1, args.jobs):
        mine = [r for r in runs if r["jobs"] == jobs]
        means[jobs] = sum(r["wall_s"] for r in mine) / len(mine)
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in mine)
        print(f"{jobs:>5} {walls:>28} "
              f"{means[jobs]:>7.1f} {mine[0]['rounds']:>7} {mine[0]['probes']:>7} "
              f"{mine[0]['capacity_speed']:>8.4g}x")
    print(f"wall time, --jobs {args.jobs} / --jobs 1: {means[args.jobs] / means[1]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"policy": args.policy, "cpus": os.cpu_count(), "runs": runs,
             "ratio": means[args.jobs] / means[1]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
