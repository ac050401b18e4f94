"""The distributed Conductor in the simulator: N replicas behind a front, each hearing of the
others' placements a sync lag late (``mooncake_sim/replicas.py``), against one Conductor.

    python benchmarks/replicas_sim.py [--replicas 2,4,8] [--lags 10,100,1000,inf]
        [--loads 0.8,1.1] [--requests 3000] [--jobs N] [--json OUT.json] [--markdown OUT.md]

Workloads: the bundled conversation trace (whole) and the paper's three synthetic shapes,
with the scheduling tables' preset and realism (``paper-fig5``: 16P + 16D, prediction
error sigma 0.2, NIC contention, 100 ms KV-event lag), at each share of the prefill
pool's cold compute in ``--loads``. Every cell is charged mean TTFT (rejections charged
the TTFT SLO) and SLO attainment, as a ratio to / difference from one Conductor on the
same requests; ``inf`` is replicas that never share their load (each sees only its own
requests, the KV events still reach every one). The front is round-robin.

The conversation trace's timestamps were rounded to 3 s steps (about ten requests share
each), so it runs twice: as recorded, and with each arrival drawn uniformly within its
step (``mooncake-conversation-spread``, one Conductor's baseline drawn the same way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from mooncake_sim.engine import SimConfig, simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.synth import PAPER_SHAPES, generate
from mooncake_sim.trace import (
    TraceRecord,
    arrival_tick_ms,
    bundled_trace,
    load_trace,
    spread_arrivals,
)

PRESET = PRESETS["paper-fig5"]
CONVERSATION = "mooncake-conversation"
#: the same trace with each arrival drawn uniformly within the tick it was rounded to
SPREAD = "mooncake-conversation-spread"
SYNTH_SEED = 7
#: the issue's goal: at most this much worse charged mean TTFT at N = 4, lag 100 ms
GOAL = (4, 100.0, 1.03)

Job = tuple[str, str, float, SimConfig]  # (workload, key, load, config)


def workloads(requests: int) -> dict[str, list[TraceRecord]]:
    recs = load_trace(bundled_trace())
    out = {CONVERSATION: recs}
    tick = arrival_tick_ms(recs)
    if tick > 0:  # its arrivals, rounded to the tick when recorded, spread again
        out[SPREAD] = spread_arrivals(recs, tick, seed=SYNTH_SEED)
    for shape in PAPER_SHAPES:
        out[f"synth-{shape}"] = generate(shape, requests, seed=SYNTH_SEED)
    return out


def variants(replicas: list[int], lags: list[float]) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("1", {})]
    for n in replicas:
        for lag in lags:
            out.append((f"{n}|{lag:g}", {"replicas": n, "replica_lag_ms": lag}))
    return out


def _run(job: tuple[str, str, float, list[TraceRecord], SimConfig]
         ) -> tuple[str, str, float, dict[str, Any]]:
    wl, key, load, recs, cfg = job
    r = simulate(recs, cfg)
    return wl, key, load, {k: r[k] for k in ("ttft_mean_charged_s", "slo_attainment",
                                             "completed", "requests", "ttft_p90_s",
                                             "wall_seconds")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = workloads(args.requests)
    jobs = []
    for wl, recs in data.items():
        for load in args.loads:
            speed = speed_for_utilization(recs, PRESET.prefill, load)
            for key, kw in variants(args.replicas, args.lags):
                jobs.append((wl, key, load, recs, PRESET.sim_config("conductor", speed, **kw)))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for wl, key, load, _, _ in jobs:  # every table and row in the jobs' order
        results.setdefault(f"{wl}|{load:g}", {})[key] = {}
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_run, j) for j in jobs]
        for k, fut in enumerate(as_completed(futures), 1):
            wl, key, load, r = fut.result()
            results[f"{wl}|{load:g}"][key] = r
            sys.stderr.write(f"[{k}/{len(jobs)}] {wl} load {load:g} {key}: charged TTFT "
                             f"{r['ttft_mean_charged_s']:.2f} s, SLO "
                             f"{r['slo_attainment']:.1%} ({time.perf_counter() - started:.0f} s)\n")
    return {"settings": {"command": "python benchmarks/replicas_sim.py " + " ".join(
        sys.argv[1:]), "preset": "paper-fig5", "loads": args.loads,
        "replicas": args.replicas, "lags_ms": [None if math.isinf(x) else x for x in args.lags],
        "requests": args.requests}, "results": results,
        "wall_seconds": time.perf_counter() - started}


def _lag(x: float | None) -> str:
    return "never" if x is None or math.isinf(x) else f"{x:g} ms"


def markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    lags = [math.inf if x is None else x for x in s["lags_ms"]]
    lines = [
        "# The distributed Conductor (simulator)",
        "",
        f"`{s['command']}` — {doc['wall_seconds'] / 60:.1f} min. Model and rule: "
        "[conductor.md](../conductor.md#replicas), `operator/mooncake_sim/replicas.py`.",
        "",
        "N Conductor replicas behind a front that spreads requests round-robin. Each "
        "hears of the others' placements "
        "(queued and running prefill work, decode joins and finishes) *lag* late; the "
        "index (KV events) is shared by all. *never*: replicas that do not share their "
        "load at all. Each cell: charged mean TTFT over one Conductor's on the same "
        "requests (rejected requests charged the TTFT SLO), then SLO attainment in points "
        "against one Conductor's. Preset `paper-fig5` (16P + 16D, prediction error σ 0.2, "
        "NIC contention, 100 ms KV-event lag); load = share of the prefill pool's cold "
        "compute.",
        "",
    ]
    for wl_load, row in doc["results"].items():
        wl, load = wl_load.rsplit("|", 1)
        one = row["1"]
        lines += [f"## {wl}, load {load}", "",
                  f"One Conductor: charged mean TTFT {one['ttft_mean_charged_s']:.2f} s, "
                  f"SLO attainment {one['slo_attainment']:.1%}.", "",
                  "| replicas | " + " | ".join(_lag(x) for x in lags) + " |",
                  "|---|" + "---:|" * len(lags)]
        names = [(str(n), f"{n}") for n in s["replicas"]]
        for key, label in names:
            cells = []
            for lag in lags:
                r = row.get(f"{key}|{lag:g}")
                if r is None:
                    cells.append("–")
                    continue
                ratio = r["ttft_mean_charged_s"] / one["ttft_mean_charged_s"]
                dslo = 100 * (r["slo_attainment"] - one["slo_attainment"])
                cells.append(f"{ratio:.3f} / {dslo:+.1f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Reading", "", *reading(doc), ""]
    return "\n".join(lines)


def _ratios(doc: dict[str, Any], n: int | None, lag: float, prefix: str = ""
            ) -> list[float]:
    """Charged-TTFT ratios to one Conductor at ``lag`` (every N when ``n`` is None), over
    the workloads whose ``workload|load`` key starts with ``prefix``."""
    out = []
    for wl_load, row in doc["results"].items():
        if not wl_load.startswith(prefix):
            continue
        one = row["1"]["ttft_mean_charged_s"]
        for key, r in row.items():
            if key == "1" or not r:
                continue
            rn, rlag = key.split("|")
            if (n is None or int(rn) == n) and float(rlag) == lag:
                out.append(r["ttft_mean_charged_s"] / one)
    return out


def reading(doc: dict[str, Any]) -> list[str]:
    n, lag, bound = GOAL
    out = []
    worst = []
    for wl_load, row in doc["results"].items():
        r = row.get(f"{n}|{lag:g}")
        if r:
            worst.append((r["ttft_mean_charged_s"] / row["1"]["ttft_mean_charged_s"], wl_load))
    if worst:
        w, where = max(worst)
        verdict = "met" if w <= bound else "**not met**"
        out.append(f"- Goal: at most {bound - 1:.0%} worse charged mean TTFT at N = {n} with "
                   f"{lag:g} ms lag: {verdict} (worst {w:.3f}, {where.replace('|', ', load ')}).")
    lags = [math.inf if x is None else x for x in doc["settings"]["lags_ms"]]
    for prefix, what in (("synth-", "the synthetic shapes"),
                         (CONVERSATION + "|", "the conversation trace as recorded"),
                         (SPREAD + "|", "the conversation trace, arrivals spread in their "
                          "steps")):
        cells = []
        for x in lags:
            rs = _ratios(doc, None, x, prefix)
            if rs:
                cells.append(f"{_lag(x)} {min(rs):.2f}–{max(rs):.2f}×")
        if cells:
            out.append(f"- On {what}, every N: " + ", ".join(cells) + ".")
    out.append(
        "- The loss is collisions: a replica that has not heard of another's latest "
        "placements sends its request to the instance that looked best to both, which the "
        "other has just filled. It grows with the lag and with how many requests arrive "
        "within one lag. The bundled conversation trace's timestamps were rounded to "
        "3 s steps (about ten requests at each instant), so as recorded any lag hides "
        "whole bursts; spread within their steps, as they arrived before the rounding, "
        "its arrivals are apart like the synthetic shapes'.")
    out.append(
        "- Not sharing at all costs the most (the *never* column), which is what two "
        "gateways behind one Service did before they exchanged their load. The live "
        "gateways ask each other every 0.05 s (about 25 ms of lag on average).")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--lags", default="10,100,1000,inf", help="ms; inf: never shared")
    ap.add_argument("--loads", default="0.8,1.1")
    ap.add_argument("--requests", type=int, default=3000, help="per synthetic workload")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--from-json", type=Path, help="only write the page from a run's JSON")
    a = ap.parse_args(argv)
    a.replicas = [int(x) for x in a.replicas.split(",") if x.strip()]
    a.lags = [float(x) for x in a.lags.split(",") if x.strip()]
    a.loads = [float(x) for x in a.loads.split(",") if x.strip()]
    if any(n < 2 for n in a.replicas) or any(x <= 0 for x in a.lags):
        ap.error("--replicas are at least 2 and --lags positive (one Conductor is the "
                 "baseline of every row; lag 0 decides as one Conductor)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    doc = json.loads(a.from_json.read_text()) if a.from_json else run(a)
    if a.json and not a.from_json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    page = markdown(doc)
    if a.markdown:
        a.markdown.write_text(page)
    print(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
