"""Overload: admitted requests keep both SLOs at 2x and 4x capacity (issue 32 item 4).

    python benchmarks/overload.py [--seeds 0,1,2] [--multiples 2,4]
        [--policies conductor,mooncake-paper,kvcache-centric] [--risk 0.01]
        [--capacity X] [--json docs/results/overload.json]
        [--markdown docs/results/overload.md] [--plot docs/results/overload.png]

The paper-fig5 preset (16 prefill + 16 decode LLaMA3-70B / 8xA800 instances, TTFT SLO
30 s, TBT SLO 100 ms, prediction error sigma 0.2, NIC contention, 100 ms KV-event lag) on
the bundled conversation trace, every design with admission offered what ``capacity``
offers by default (overload shedding, work stealing, holding: the fair default).

1. **Capacity.** The conductor's effective capacity (:mod:`mooncake_sim.capacity`: the
   highest replay speed with at least 90% of all requests within both SLOs), searched as
   ``mooncake-operator capacity --policy conductor --preset paper-fig5 --jobs 1`` does,
   seed 0 (``--capacity X`` skips the search). The same search with the error margin on.
2. **Overload.** Replays at ``--multiples`` of that speed, seeds ``--seeds``, for every
   design with admission: the share of *admitted* (not rejected) requests within both
   SLOs (the issue's target: at least 99%), within each SLO, the rejected share, TTFT
   p50/p99 of the admitted, TBT p99, goodput (requests within both SLOs per second of
   the replay's arrival span) and the prefill GPU seconds spent on admitted requests that
   missed. Each with the paper's admission rule (``prediction``) and with the error
   margin (``prediction``, ``ttft_miss_risk`` = ``--risk``; :mod:`mooncake_conductor.
   admission.risk`).
3. **Table 3 analogue.** At the lowest multiple: the naive rule on the current queue
   (``current-load``) against the prediction rule and the margin, with shedding on (the
   fair default) and off (the rules alone, as in the paper's table), rejections counted
   and rejections per 5 s window (their spread is the oscillation the paper describes).
4. **Normal load.** The conductor with its own defaults on the conversation trace at 80%
   load (the scheduling results' setting) with and without the margin.

The margin's one constant, ``--risk`` 0.01, is the issue's target (99% of the admitted
within SLO), not fitted to this trace; the error's sigma is measured online.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mooncake_conductor.policies.registry import policy_class
from mooncake_sim.capacity import (
    DEFAULT_REL_TOL,
    DEFAULT_TARGET,
    compute_bound_speed,
    search_capacity,
)
from mooncake_sim.engine import Simulation
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.trace import TraceRecord, bundled_trace, load_trace

PRESET = PRESETS["paper-fig5"]
#: the fair default of ``capacity``: every design with admission offered all three
FAIR = {"shedding": {"enabled": True}, "stealing": {"enabled": True},
        "holding": {"enabled": True}}
#: rule label -> the ConductorConfig.admission_rule it stands for (risk filled in later)
RULES = ("current-load", "prediction", "prediction+margin")
WINDOW_S = 5.0
LOOKAHEAD = "tbt-lookahead"  # rejections are counted per this many simulated seconds


def rule_config(rule: str, risk: float) -> dict[str, Any]:
    if rule == "prediction+margin":
        return {"rule": "prediction", "ttft_miss_risk": risk}
    return {"rule": rule}


def replay(records: list[TraceRecord], policy: str, speed: float, seed: int, rule: str,
           risk: float, *, fair: bool = True, shedding: bool | None = None,
           windows: bool = False, decode: str | None = None) -> dict[str, Any]:
    """One replay and what it reports about the admitted requests."""
    conductor: dict[str, Any] = {"seed": seed, "admission_rule": rule_config(rule, risk)}
    if decode is not None:
        conductor["decode_selector"] = decode
    if fair:
        conductor.update(FAIR)
    if shedding is not None:
        conductor["shedding"] = {"enabled": shedding}
    cfg = PRESET.sim_config(policy, speed, conductor=conductor)
    sim = Simulation(records, cfg)
    res = sim.run()
    slo = cfg.conductor.slo
    served = [r for r in sim.reqs if r.decision is not None and not r.decision.rejected]
    ttft_ok = [r.ttft <= slo.ttft_s for r in served]
    tbt_ok = [r.tbt <= slo.tbt_s for r in served]
    both = sum(a and b for a, b in zip(ttft_ok, tbt_ok, strict=True))
    n = len(sim.reqs)
    arrivals = [r.info.arrival for r in sim.reqs]
    span = max(arrivals) - min(arrivals)
    out: dict[str, Any] = {
        "policy": policy, "speed": speed, "seed": seed, "rule": rule,
        "decode": sim.conductor.decode_selector.name,
        "shedding": True if shedding is None and fair else shedding,
        "requests": n, "admitted": len(served), "rejected": n - len(served),
        "rejected_share": (n - len(served)) / n,
        "reject_reasons": res["reject_reasons"],
        "admitted_slo_share": both / len(served) if served else math.nan,
        "admitted_ttft_share": sum(ttft_ok) / len(served) if served else math.nan,
        "admitted_tbt_share": sum(tbt_ok) / len(served) if served else math.nan,
        "ttft_misses": len(served) - sum(ttft_ok), "tbt_misses": len(served) - sum(tbt_ok),
        "slo_attainment": res["slo_attainment"],
        "ttft_p50_s": res["ttft_p50_s"], "ttft_p99_s": res["ttft_p99_s"],
        "ttft_mean_charged_s": res["ttft_mean_charged_s"],
        "tbt_p99_ms": res["tbt_p99_ms"],
        "goodput_rps": both / span if span > 0 else math.nan,
        "prefill_gpu_s": res["prefill_gpu_seconds"],
        "wasted_gpu_s": sum(r.exec_s for r, a, b in zip(served, ttft_ok, tbt_ok, strict=True)
                            if not (a and b)),
        "held": res["held"], "steals": res["steals"],
        "span_s": span, "wall_s": res["wall_seconds"],
    }
    missed = [r for r, ok in zip(served, ttft_ok, strict=True) if not ok]
    if missed:  # what the TTFT misses were predicted at, and by how much they overran
        pred = [r.decision.placement.ttft_s for r in missed if r.decision is not None]
        out["miss_predicted_ttft_p50_s"] = statistics.median(pred)
        out["miss_overrun_p50_s"] = statistics.median(
            r.ttft - p for r, p in zip(missed, pred, strict=True))
        out["miss_own_prefill_share"] = statistics.fmean(
            r.decision.placement.prefill_s / r.decision.placement.ttft_s for r in missed
            if r.decision is not None and r.decision.placement.ttft_s > 0)
    out["tbt_miss_decodes"] = len({r.decision.decode.decode for r, ok in
                                   zip(served, tbt_ok, strict=True)
                                   if not ok and r.decision is not None})
    if windows:
        start = min(arrivals)
        counts = [0] * (int(span // WINDOW_S) + 1)
        offered = [0] * len(counts)
        for r in sim.reqs:
            w = int((r.info.arrival - start) // WINDOW_S)
            offered[w] += 1
            if r.decision is None or r.decision.rejected:
                counts[w] += 1
        out["rejections_per_window"] = counts
        out.update(_oscillation(counts))
        # the arrivals' own swing per window: what the rejections' would be if they
        # followed the offered load and nothing else
        out["arrivals_cv"] = statistics.pstdev(offered) / statistics.fmean(offered)
    return out


def _oscillation(counts: list[int]) -> dict[str, float]:
    """How the rejections per window swing: their coefficient of variation, the share of
    windows with none, and the lag-1 autocorrelation (negative: on-off alternation)."""
    mean = statistics.fmean(counts)
    sd = statistics.pstdev(counts)
    if len(counts) > 2 and sd > 0:
        lag1 = sum((a - mean) * (b - mean) for a, b in itertools.pairwise(counts))
        lag1 /= sd * sd * (len(counts) - 1)
    else:
        lag1 = math.nan
    return {"rejections_cv": sd / mean if mean else math.nan,
            "windows_without_rejection": sum(c == 0 for c in counts) / len(counts),
            "rejections_lag1": lag1}


def capacity(records: list[TraceRecord], risk: float | None, log: Any) -> dict[str, Any]:
    """The conductor's effective capacity, seed 0, the fair default, as ``capacity
    --jobs 1`` searches it (from the compute-bound limit, 2% tolerance)."""
    conductor: dict[str, Any] = {"seed": 0, **FAIR}
    if risk is not None:
        conductor["admission_rule"] = {"ttft_miss_risk": risk}
    probes: list[dict[str, float]] = []

    def attainment(speed: float) -> float:
        res = Simulation(records, PRESET.sim_config("conductor", speed,
                                                    conductor=conductor)).run()
        probes.append({"speed": speed, "slo_attainment": res["slo_attainment"]})
        log(f"capacity{' (margin)' if risk else ''}: {speed:.3f}x -> "
            f"{res['slo_attainment']:.2%} in SLO")
        return float(res["slo_attainment"])

    start = compute_bound_speed(records, PRESET.prefill)
    found = search_capacity(attainment, start, target=DEFAULT_TARGET, rel_tol=DEFAULT_REL_TOL)
    return {"capacity_speed": found.capacity_speed, "bracketed": found.bracketed,
            "start": start, "probes": probes, "risk": risk}


def run(args: argparse.Namespace) -> dict[str, Any]:
    records = load_trace(bundled_trace())
    seeds = [int(s) for s in args.seeds.split(",")]
    multiples = [float(m) for m in args.multiples.split(",")]
    policies = [p.strip() for p in args.policies.split(",")]
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    caps: dict[str, Any] = {}
    if args.capacity is None:
        caps["prediction"] = capacity(records, None, log)
        caps["prediction+margin"] = capacity(records, args.risk, log)
        cap = caps["prediction"]["capacity_speed"]
    else:
        cap = args.capacity
    log(f"capacity {cap:.3f}x; overload runs")

    def show(tag: str, r: dict[str, Any]) -> None:
        log(f"{tag} {r['policy']:<15} {r['rule']:<17} seed {r['seed']}: admitted within "
            f"SLO {r['admitted_slo_share']:.2%}, rejected {r['rejected_share']:.1%} "
            f"({r['wall_s']:.1f} s)")

    overload = []
    for m in multiples:
        for policy in policies:
            for rule in ("prediction", "prediction+margin"):
                for seed in seeds:
                    r = replay(records, policy, m * cap, seed, rule, args.risk,
                               windows=m == multiples[0] and policy == "conductor")
                    r["multiple"] = m
                    overload.append(r)
                    show(f"{m:g}x", r)
    # the paper's decode check prices the running batch only; the designs that use it,
    # again with the look-ahead selector (conductor's), which counts requests placed
    for m in multiples:
        for policy in policies:
            if policy_class(policy).default_decode == LOOKAHEAD:
                continue
            for seed in seeds:
                r = replay(records, policy, m * cap, seed, "prediction+margin", args.risk,
                           decode=LOOKAHEAD)
                r["multiple"] = m
                overload.append(r)
                show(f"{m:g}x, look-ahead decode", r)
    table3 = []
    low = multiples[0]
    for shedding in (True, False):
        for policy in (policies if shedding else ["conductor"]):
            for rule in RULES:
                for seed in seeds:
                    reuse = [r for r in overload if shedding and r["multiple"] == low
                             and r["policy"] == policy and r["rule"] == rule
                             and r["seed"] == seed]
                    if reuse:
                        r = reuse[0]
                    else:
                        r = replay(records, policy, low * cap, seed, rule, args.risk,
                                   shedding=shedding, windows=policy == "conductor")
                        r["multiple"] = low
                        show(f"table 3, shedding {'on' if shedding else 'off'}", r)
                    table3.append(r)
    normal = []
    speed80 = speed_for_utilization(records, PRESET.prefill, PRESET.target_utilization)
    for rule in ("prediction", "prediction+margin"):
        for seed in seeds:
            r = replay(records, "conductor", speed80, seed, rule, args.risk, fair=False)
            normal.append(r)
            show("80% load", r)
    return {
        "settings": {
            "preset": PRESET.name, "prefill": PRESET.prefill, "decode": PRESET.decode,
            "ttft_slo_s": PRESET.ttft_slo_s, "tbt_slo_ms": PRESET.tbt_slo_ms,
            "prediction_error": PRESET.prediction_error, "trace": "conversation (bundled)",
            "requests": len(records), "seeds": seeds, "multiples": multiples,
            "policies": policies, "risk": args.risk, "capacity_speed": cap,
            "capacity_given": args.capacity is not None, "load_80_speed": speed80,
            "window_s": WINDOW_S, "capabilities": "fair default: shedding, stealing, holding",
            "command": "python benchmarks/overload.py " + " ".join(sys.argv[1:]),
        },
        "capacity": caps,
        "overload": overload,
        "table3": table3,
        "normal": normal,
        "wall_seconds": time.perf_counter() - started,
    }


MEANS = ("admitted_slo_share", "admitted_ttft_share", "admitted_tbt_share", "rejected_share",
         "rejected", "ttft_misses", "tbt_misses", "ttft_p50_s", "ttft_p99_s", "tbt_p99_ms",
         "goodput_rps", "slo_attainment", "ttft_mean_charged_s", "wasted_gpu_s",
         "prefill_gpu_s", "admitted", "requests")


def _group(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Rows grouped by ``keys``, each group the mean over seeds (and min/max of the
    admitted share)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = {}
    for key, rs in groups.items():
        row: dict[str, Any] = {k: statistics.fmean(r[k] for r in rs) for k in MEANS}
        row["admitted_slo_min"] = min(r["admitted_slo_share"] for r in rs)
        row["runs"] = len(rs)
        for extra in ("rejections_cv", "windows_without_rejection", "rejections_lag1",
                      "arrivals_cv",
                      "miss_predicted_ttft_p50_s", "miss_overrun_p50_s",
                      "miss_own_prefill_share"):
            vals = [r[extra] for r in rs if extra in r]
            row[extra] = statistics.fmean(vals) if vals else math.nan
        out[key] = row
    return out


def _pct(x: float, digits: int = 2) -> str:
    return "–" if x != x else f"{100 * x:.{digits}f}%"


def markdown(out: dict[str, Any], plot: str | None = None) -> str:
    s = out["settings"]
    cap = s["capacity_speed"]
    ov = _group(out["overload"], "multiple", "policy", "rule", "decode")
    t3 = _group(out["table3"], "shedding", "policy", "rule")
    nm = _group(out["normal"], "rule")
    lines = [
        "# Overload: admitted requests within both SLOs at 2× and 4× capacity",
        "",
        f"`{s['command'].strip()}` — {out['wall_seconds']:.0f} s on this project's 2-core "
        "host (one core used). Issue 32 item 4, simulator part.",
        "",
        f"paper-fig5 preset ({s['prefill']} prefill + {s['decode']} decode, TTFT SLO "
        f"{s['ttft_slo_s']:g} s, TBT SLO {s['tbt_slo_ms']:g} ms, prediction error σ "
        f"{s['prediction_error']:g}, NIC contention, 100 ms event lag), bundled conversation "
        f"trace ({s['requests']:,} requests), seeds {', '.join(map(str, s['seeds']))}; every "
        "number is the mean over the seeds unless marked *min*. Every design with admission "
        "is offered overload shedding, work stealing and holding (`capacity`'s default). "
        "*Admitted within SLO*: the share of the requests not rejected that met both TTFT "
        "and TBT SLOs (the issue's target: ≥ 99%). *Goodput*: requests within both SLOs per "
        "second of the replay's arrival span. *Wasted*: prefill GPU seconds (node-seconds) "
        "spent on admitted requests that missed. *margin*: the prediction rule with "
        f"`admission_rule.ttft_miss_risk: {s['risk']:g}` (admit only with at most a "
        f"{_pct(s['risk'], 0)} chance of missing the TTFT SLO under the measured prediction "
        "error; `mooncake_conductor/admission/risk.py`).",
        "",
        "## Capacity",
        "",
    ]
    if out["capacity"]:
        c0, c1 = out["capacity"]["prediction"], out["capacity"]["prediction+margin"]
        lines += [
            "Effective capacity of `conductor` (≥ 90% of all requests within both SLOs, "
            "seed 0, searched as `mooncake-operator capacity --policy conductor --preset "
            "paper-fig5 --jobs 1`; docs/results/scheduling.md published 7.61×):",
            "",
            "| admission | capacity | probes |",
            "|---|---:|---:|",
            f"| prediction (default) | {c0['capacity_speed']:.2f}× | {len(c0['probes'])} |",
            f"| prediction + margin | {c1['capacity_speed']:.2f}× | {len(c1['probes'])} |",
            "",
            f"The overload runs use {cap:.2f}× (the default's) as 1×: 2× = "
            f"{2 * cap:.2f}×, 4× = {4 * cap:.2f}× replay speed.",
            "",
        ]
    else:
        lines += [f"Given: {cap:.2f}× replay speed (not searched in this run).", ""]
    lines += [
        "## Admitted requests at 2× and 4× capacity",
        "",
        "| load | design | admission | decode | admitted within SLO | *min* | within TTFT "
        "| within TBT | rejected | TTFT p50 | TTFT p99 | TBT p99 | goodput | wasted |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (m, policy, rule, decode), r in sorted(
            ov.items(), key=lambda kv: (kv[0][0], s["policies"].index(kv[0][1]),
                                        kv[0][3] == LOOKAHEAD, kv[0][2])):
        label = "margin" if rule == "prediction+margin" else rule
        lines.append(
            f"| {m:g}× | {policy} | {label} | {decode} | **{_pct(r['admitted_slo_share'])}** | "
            f"{_pct(r['admitted_slo_min'])} | {_pct(r['admitted_ttft_share'])} | "
            f"{_pct(r['admitted_tbt_share'])} | {_pct(r['rejected_share'], 1)} | "
            f"{r['ttft_p50_s']:.1f} s | {r['ttft_p99_s']:.1f} s | {r['tbt_p99_ms']:.0f} ms | "
            f"{r['goodput_rps']:.2f}/s | {r['wasted_gpu_s']:.0f} s |")
    low = s["multiples"][0]
    lines += [
        "",
        f"## Table 3 analogue: rejection on current load against prediction ({low:g}× "
        "capacity)",
        "",
        "The paper (FAST'25 §7.4, Table 3) counts rejected requests on one overloaded "
        "workload: 4183 for a baseline that rejects on the current load, 3771 for early "
        "rejection, 3589 for early rejection based on prediction. Here: `current-load` "
        "rejects when the chosen instance's queue *now* passes the TTFT SLO "
        "(`mooncake_conductor/admission/current_load.py`: the request's own prefill and "
        "transfer not counted), `prediction` when the predicted TTFT does (the default), "
        "`margin` when its 99% quantile does. Same placements, decode choice and "
        "(where on) shedding; only the TTFT admission rule differs. *Served within SLO*: "
        "requests (of all) that met both SLOs.",
        "",
        "| shedding | design | admission | rejected | of which ttft-slo | served within "
        "SLO | admitted within SLO | wasted | rejections per 5 s: CV | arrivals per 5 s: CV "
        "| windows with none | lag-1 autocorr. |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (shed, policy, rule), r in t3.items():
        label = "margin" if rule == "prediction+margin" else rule
        rows = [x for x in out["table3"] if x["shedding"] == shed and x["policy"] == policy
                and x["rule"] == rule]
        ttft_rej = statistics.fmean(x["reject_reasons"].get("ttft-slo", 0) for x in rows)
        served_ok = statistics.fmean(x["slo_attainment"] * x["requests"] for x in rows)
        osc = (f"{r['rejections_cv']:.2f} | {r['arrivals_cv']:.2f} | "
               f"{_pct(r['windows_without_rejection'], 0)} | {r['rejections_lag1']:.2f}"
               if r["rejections_cv"] == r["rejections_cv"] else "– | – | – | –")
        lines.append(
            f"| {'on' if shed else 'off'} | {policy} | {label} | {r['rejected']:.0f} | "
            f"{ttft_rej:.0f} | {served_ok:.0f} | {_pct(r['admitted_slo_share'])} | "
            f"{r['wasted_gpu_s']:.0f} s | {osc} |")
    if plot:
        lines += ["", f"![rejections per 5 s window, seed 0]({plot})"]
    p0, p1 = nm[("prediction",)], nm[("prediction+margin",)]
    lines += [
        "",
        "## The margin at normal load",
        "",
        f"`conductor` with its own defaults, conversation trace at 80% load "
        f"({s['load_80_speed']:.2f}× replay speed; the setting of "
        "docs/results/scheduling.md, not republished here):",
        "",
        "| admission | rejected | SLO attainment (all) | admitted within SLO | charged "
        "mean TTFT | TTFT p99 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in (("prediction (default)", p0), ("margin", p1)):
        lines.append(
            f"| {label} | {r['rejected']:.1f} | {_pct(r['slo_attainment'])} | "
            f"{_pct(r['admitted_slo_share'])} | {r['ttft_mean_charged_s']:.3f} s | "
            f"{r['ttft_p99_s']:.2f} s |")
    lines += ["", *_reading(out, ov, t3, p0, p1), "", *_short(out)]
    return "\n".join(lines) + "\n"


def _short(out: dict[str, Any]) -> list[str]:
    """What this page does not show."""
    s = out["settings"]
    span = statistics.fmean(r["span_s"] for r in out["overload"] if r["multiple"] == 2.0) \
        if 2.0 in s["multiples"] else math.nan
    return [
        "## What falls short",
        "",
        f"- **Short replays.** At 2× capacity the trace's arrivals span {span:.0f} s, a few "
        f"TTFT SLOs ({s['ttft_slo_s']:g} s): a good part of each replay is the queues "
        "filling up to the horizon and draining. One trace, one preset, three seeds.",
        "- **Prefill-bound only.** No request was held and the decode pool never "
        "refused (`tbt-slo`) at these loads, so the decode side's admission is exercised "
        "only by the pile-up above; a decode-bound overload (e.g. the `long-output` "
        "shape) was not run.",
        "- **The margin's model.** It assumes each prefill's error is independent and "
        "log-normal (what the simulator draws). On a real GPU the error follows the "
        "prompt's shape (docs/cost-model.md), so errors of similar prompts queued "
        "together add up rather than average out: the margin would be too narrow there. A "
        "CPP placement is priced as one item on its leader's queue.",
        "- **Off by default**: `spec.conductor.ttftMissRisk` in a `MooncakeCluster` (the "
        "core's `conductor.admission_rule.ttft_miss_risk`) turns it on. At 80% "
        "load it turns away about 40 more requests in 12,031.",
        "- **The Table 3 analogue is a reading.** The paper's rules judge the decode side "
        "(its baseline, as we read §6, refuses at the decode stage after the prefill was "
        "spent); this overload is prefill-bound and the "
        "naive rule is ours (the queue now, against the SLO). The ordering matches; the "
        "counts do not compare. The oscillation the paper shows is not visible in the "
        "rejection counts here.",
        "- **Capacity with the margin** is one seed's search (2% tolerance); the gain over "
        "the default was not confirmed over seeds.",
        "- **The paper designs' TBT pile-up** appeared in one run of twelve; it is fixed "
        "by the look-ahead selector, which is not their own default (they keep the "
        "paper's check).",
    ]


def _reading(out: dict[str, Any], ov: dict[tuple[Any, ...], dict[str, Any]],
             t3: dict[tuple[Any, ...], dict[str, Any]], p0: dict[str, Any],
             p1: dict[str, Any]) -> list[str]:
    """What met the target and what falls short, read from the tables."""
    s = out["settings"]
    own = {p: policy_class(p).default_decode for p in s["policies"]}
    default = {k: r for k, r in ov.items() if k[2] == "prediction"}
    margin = {k: r for k, r in ov.items() if k[2] == "prediction+margin" and k[3] == own[k[1]]}
    ahead = {k: r for k, r in ov.items() if k[2] == "prediction+margin" and k[3] != own[k[1]]}

    def where(k: tuple[Any, ...]) -> str:
        return f"{k[1]} at {k[0]:g}×"

    met = [where(k) for k, r in default.items() if r["admitted_slo_min"] >= 0.99]
    missed = [f"{where(k)} ({_pct(r['admitted_slo_share'])}, min {_pct(r['admitted_slo_min'])})"
              for k, r in default.items() if r["admitted_slo_min"] < 0.99]
    why = [r for r in default.values() if r["miss_overrun_p50_s"] == r["miss_overrun_p50_s"]]
    p50s = [r["ttft_p50_s"] for r in default.values()]
    tbt_default = sum(r["tbt_misses"] for r in default.values())
    m_met = [where(k) for k, r in margin.items() if r["admitted_slo_min"] >= 0.99]
    m_missed = [f"{where(k)} (min {_pct(r['admitted_slo_min'])}: "
                f"{_pct(r['admitted_ttft_share'])} within TTFT, "
                f"{_pct(r['admitted_tbt_share'])} within TBT)"
                for k, r in margin.items() if r["admitted_slo_min"] < 0.99]
    herd = [x for x in out["overload"] if x["rule"] == "prediction+margin"
            and x["decode"] == own[x["policy"]] and x["tbt_misses"]]
    ttft_min = min(r["admitted_ttft_share"] for r in margin.values())
    gp = [margin[(k[0], k[1], "prediction+margin", k[3])]["goodput_rps"] / r["goodput_rps"]
          for k, r in default.items()]
    ahead_min = min((r["admitted_slo_min"] for r in ahead.values()), default=math.nan)
    low = s["multiples"][0]
    cl = t3[(True, "conductor", "current-load")]
    pr = t3[(True, "conductor", "prediction")]
    mg = t3[(True, "conductor", "prediction+margin")]
    cl_off = t3[(False, "conductor", "current-load")]
    pr_off = t3[(False, "conductor", "prediction")]
    mg_off = t3[(False, "conductor", "prediction+margin")]
    cvs = [r["rejections_cv"] for k, r in t3.items() if k[1] == "conductor"]
    none = [r["windows_without_rejection"] for k, r in t3.items() if k[1] == "conductor"]
    caps = out["capacity"]
    lines = [
        "## Reading",
        "",
        "- **The paper's rule (the default) meets ≥ 99% in every seed** for "
        f"{', '.join(met) or 'none'}; **it misses** for {', '.join(missed) or 'none'}.",
        f"- **Why**: TTFT. With the default rule no admitted request missed the TBT SLO "
        f"({tbt_default:.0f} in all; the decode pool is not the bottleneck at these "
        "loads). Under overload the prefill queues fill up to the SLO (TTFT p50 of the "
        f"admitted {min(p50s):.0f}–{max(p50s):.0f} s) and a prediction is a median: the "
        "requests that missed were predicted at "
        f"{min(r['miss_predicted_ttft_p50_s'] for r in why):.0f}–"
        f"{max(r['miss_predicted_ttft_p50_s'] for r in why):.0f} s (median per row) and "
        f"took {min(r['miss_overrun_p50_s'] for r in why):.1f}–"
        f"{max(r['miss_overrun_p50_s'] for r in why):.1f} s longer. That is the error of "
        "the queue ahead of them, not of their own prefill (at most "
        f"{_pct(max(r['miss_own_prefill_share'] for r in why), 0)} of their predicted "
        "TTFT on average): each prefill is off by its σ 0.2 log-normal factor, and a queue "
        "of a few long prompts does not average that out. The predictor, calibrated to the "
        "median, is also 2% short on the mean (e^(σ²/2)).",
        "- **The margin** (`ttft_miss_risk` 0.01: admit only with at most a 1% chance of a "
        "TTFT miss, from the measured error) meets ≥ 99% in every seed for "
        f"{', '.join(m_met) or 'none'}"
        + (f"; not for {', '.join(m_missed)}" if m_missed else "")
        + f". Within TTFT alone it keeps ≥ {_pct(ttft_min)} of the admitted (mean per row) "
        f"and it serves more within SLO: goodput {min(gp):.3f}–{max(gp):.3f}× the "
        "default's (shorter queues, so overload shedding fires less).",
    ]
    if herd:
        lines.append(
            "- **TBT, where it broke**: "
            + "; ".join(f"{x['policy']} at {x['multiple']:g}× seed {x['seed']}: "
                        f"{x['tbt_misses']} admitted requests missed the TBT SLO, all on "
                        f"{x['tbt_miss_decodes']} decode instance(s)" for x in herd)
            + ". The paper's decode check (`tbt-slo`) prices the batch running *now*; with "
            "prefill queues 25 s deep, the arrivals of several seconds all see the same "
            "lightly loaded decode instance (predicted TBT about 15 ms in the run we "
            "examined), are sent there, and join it together 25 s later: the lag the "
            "paper's prediction-based early rejection is about (§6). The decode-side fix "
            f"exists: with `{LOOKAHEAD}` (conductor's selector, which counts the requests "
            "placed whose prefill still runs) the paper designs with the margin keep "
            f"≥ {_pct(ahead_min)} in every seed (the *{LOOKAHEAD}* rows).")
    elif ahead:
        lines.append(
            f"- **Decode**: with `{LOOKAHEAD}` the paper designs with the margin keep "
            f"≥ {_pct(ahead_min)} in every seed.")
    lines += [
        f"- **Table 3 analogue** ({low:g}×, conductor): `current-load` rejects "
        f"{cl['rejected']:.0f} against {pr['rejected']:.0f} (`prediction`) and "
        f"{mg['rejected']:.0f} (margin) with shedding on, and {cl_off['rejected']:.0f} "
        f"against {pr_off['rejected']:.0f} and {mg_off['rejected']:.0f} with it off; it "
        f"serves {cl['slo_attainment'] * cl['requests']:.0f} within SLO against "
        f"{pr['slo_attainment'] * pr['requests']:.0f} and "
        f"{mg['slo_attainment'] * mg['requests']:.0f}, and wastes {cl['wasted_gpu_s']:.0f} "
        f"GPU seconds on admitted misses against {pr['wasted_gpu_s']:.0f} and "
        f"{mg['wasted_gpu_s']:.0f}. "
        + ("The ordering is the paper's (current load > prediction > prediction with "
           "margin)" if cl["rejected"] > pr["rejected"] > mg["rejected"]
           else "The ordering of rejections is not entirely the paper's")
        + ", with a far larger gap in what is served: a rule blind to the request's own "
        "prefill fills the queues with long prompts that then miss.",
        "- **Oscillation** (rejections per 5 s, conductor, seed 0 plotted): the rejections "
        f"swing {cl['rejections_cv'] / cl['arrivals_cv']:.1f}× as much as the arrivals "
        f"(CV {min(cvs):.2f}–{max(cvs):.2f} over the three rules against "
        f"{cl['arrivals_cv']:.2f}), alike for every rule, and at most "
        f"{_pct(max(none), 0)} of the windows have none: no on/off waves in the rejection "
        "counts. The paper's waves come from the lag between admitting a request and its "
        "load reaching decode; in this prefill-bound setting that lag shows only as the "
        "TBT pile-up above, not in the rejection counts.",
        f"- **At normal load the margin costs a little**: {p1['rejected']:.0f} rejected "
        f"instead of {p0['rejected']:.0f} at 80% load (SLO attainment "
        f"{_pct(p0['slo_attainment'])} → {_pct(p1['slo_attainment'])}, charged mean TTFT "
        f"{p0['ttft_mean_charged_s']:.3f} → {p1['ttft_mean_charged_s']:.3f} s): long "
        "prompts whose own prefill is predicted near the SLO are refused though most "
        "would make it. So it is an option (`admission_rule.ttft_miss_risk`), off by "
        "default.",
    ]
    if caps:
        lines.append(
            f"- **Capacity**: {caps['prediction']['capacity_speed']:.2f}× with the default, "
            f"{caps['prediction+margin']['capacity_speed']:.2f}× with the margin (seed 0, "
            "2% tolerance: one seed's search, not a measured gain).")
    return lines


def plot_windows(out: dict[str, Any], path: Path) -> bool:
    """Rejections per window over time for the conductor's rules at the lowest multiple,
    seed 0, shedding on and off; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for ax, shed in zip(axes, (True, False), strict=True):
        for rule in RULES:
            rows = [r for r in out["table3"] if r["policy"] == "conductor"
                    and r["shedding"] == shed and r["rule"] == rule and r["seed"] == 0
                    and "rejections_per_window" in r]
            if rows:
                c = rows[0]["rejections_per_window"]
                ax.plot([i * WINDOW_S for i in range(len(c))], c, lw=0.8,
                        label="margin" if rule == "prediction+margin" else rule)
        ax.set_ylabel(f"rejected / {WINDOW_S:g} s")
        ax.set_title(f"conductor, {out['settings']['multiples'][0]:g}× capacity, seed 0, "
                     f"shedding {'on' if shed else 'off'}", fontsize=9)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("simulated seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--multiples", default="2,4", help="multiples of the capacity")
    ap.add_argument("--policies", default="conductor,mooncake-paper,kvcache-centric",
                    help="designs with admission")
    ap.add_argument("--risk", type=float, default=0.01,
                    help="the margin's chance of a TTFT miss (the issue's 99%% target)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="the conductor's capacity (replay speed); default: searched")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, default=None,
                    help="only write the markdown page (and plot) from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json is not None:
        out = json.loads(args.from_json.read_text())
    else:
        out = run(args)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2) + "\n")
    plotted = args.plot is not None and plot_windows(out, args.plot)
    rel = None
    if plotted and args.markdown is not None:
        rel = args.plot.resolve().relative_to(args.markdown.resolve().parent).as_posix()
    page = markdown(out, rel)
    if args.markdown:
        args.markdown.write_text(page)
    else:
        print(page)
    print(f"wall time {out['wall_seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
