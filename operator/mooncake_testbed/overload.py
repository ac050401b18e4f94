"""Overload on the embedded cluster (issue 32 item 4, the live part; the simulator's is
``benchmarks/overload.py``): judge one replay sent at a multiple of the cluster's
effective capacity, from its per-request outcomes and samples of the gateways.

Definitions (the published page repeats them):

- *admitted*: every request the gateway did not answer with 429 (completed or failed);
  a failed one counts as a miss.
- *admitted within SLO*: admitted requests whose TTFT and TBT both met their SLO, over
  the admitted; *within TTFT* / *within TBT* the same for one SLO alone.
- *429 latency*: wall time from a rejected request's send to its answer. The gateways'
  own part (:func:`gateway_rejection_times`): from a request's arrival in a gateway to
  its 429, refused at once or after holding for decode room, read from their
  ``mooncake_gateway_rejection_seconds`` buckets (a quantile is the bucket bound it
  falls under).
- *RSS growth*: each gateway process's resident memory, sampled while the replay runs;
  the largest sample after warm-up (the first :data:`WARMUP_SHARE` of the replay) over
  the last sample in warm-up, minus one; the worst gateway is reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mooncake_sim.metrics import percentile

JsonDict = dict[str, Any]
#: share of the replay's wall time counted as warm-up for memory growth
WARMUP_SHARE = 0.25
#: a prefill answered this many times later than predicted counts as late
LATE_RATIO = 1.5


def judge(outcomes: Iterable[Mapping[str, Any]], ttft_slo_s: float,
          tbt_slo_s: float) -> JsonDict:
    """Counts and latencies of one replay's ``outcomes`` (the replay's ``keep_outcomes``
    records: status, modelled ``ttft_s`` / ``tbt_s``, wall ``sent_s`` / ``done_s``)."""
    outs = list(outcomes)
    served = [o for o in outs if o["status"] == "ok"]
    rejected = [o for o in outs if o["status"] == "rejected"]
    failed = [o for o in outs if o["status"] == "failed"]
    admitted = len(served) + len(failed)
    in_ttft = sum(1 for o in served if o["ttft_s"] <= ttft_slo_s)
    in_tbt = sum(1 for o in served if o["tbt_s"] <= tbt_slo_s)
    in_both = sum(1 for o in served
                  if o["ttft_s"] <= ttft_slo_s and o["tbt_s"] <= tbt_slo_s)
    reject_ms = sorted(1000.0 * (o["done_s"] - o["sent_s"]) for o in rejected)
    ttfts = sorted(float(o["ttft_s"]) for o in served)
    tbts = sorted(1000.0 * float(o["tbt_s"]) for o in served)

    def share(n: int) -> float:
        return n / admitted if admitted else math.nan

    return {
        "requests": len(outs), "completed": len(served), "rejected": len(rejected),
        "failed": len(failed), "admitted": admitted,
        "admitted_within_slo": share(in_both), "within_ttft": share(in_ttft),
        "within_tbt": share(in_tbt),
        "rejected_share": len(rejected) / len(outs) if outs else math.nan,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "tbt_p99_ms": percentile(tbts, 0.99),
        "reject_ms_p50": percentile(reject_ms, 0.5),
        "reject_ms_p99": percentile(reject_ms, 0.99),
        "reject_ms_max": reject_ms[-1] if reject_ms else math.nan,
    }


def sole_answer(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The prefill attempt of a gateway decision record that was its only one and answered
    (HTTP 200), else ``None``: its ``answered_s`` and ``predicted_s`` time one placement
    to one answer, with no retry or steal between them."""
    tries = record.get("attempts") or []
    if len(tries) == 1 and tries[0].get("status") == 200:
        return tries[0]  # type: ignore[no-any-return]
    return None


def prefill_predictions(decisions: Iterable[Mapping[str, Any]], since: float) -> JsonDict:
    """How the gateways' admission saw the prefill side, from their decision records made
    at or after wall time ``since``: for each admitted request answered by its first
    prefill attempt, the predicted placement-to-answer seconds (``predicted_s``, what
    admission held against the TTFT SLO) and the measured ones (``answered_s``), both
    modelled seconds. ``ratio_*`` are quantiles of measured / predicted; ``late_share``:
    the share answered more than 1.5x later than predicted."""
    pairs = []
    for d in decisions:
        if float(d.get("time", 0.0)) < since or d.get("reject_reason"):
            continue
        only = sole_answer(d)
        if only is not None and only.get("predicted_s"):
            pairs.append((float(only["predicted_s"]), float(only["answered_s"])))
    if not pairs:
        return {"answered": 0}
    ratios = sorted(a / p for p, a in pairs)
    return {
        "answered": len(pairs),
        "predicted_mean_s": sum(p for p, _ in pairs) / len(pairs),
        "answered_mean_s": sum(a for _, a in pairs) / len(pairs),
        "ratio_p50": percentile(ratios, 0.5), "ratio_p90": percentile(ratios, 0.9),
        "late_share": sum(1 for r in ratios if r > LATE_RATIO) / len(ratios),
    }


def gateway_rejection_times(buckets: Mapping[str, int], quantile: float = 0.99) -> JsonDict:
    """Per path (``at-once``, ``after-hold``): how many 429s and the bound of the bucket
    that holds the ``quantile`` of the gateways' time to them, from the increase of their
    cumulative ``<path>/<le>`` buckets over a replay (summed over the gateways)."""
    paths: dict[str, list[tuple[float, int]]] = {}
    for key, n in buckets.items():
        path, _, le = key.rpartition("/")
        paths.setdefault(path, []).append((float(le), n))
    out: JsonDict = {}
    for path, rows in sorted(paths.items()):
        rows.sort()
        total = rows[-1][1] if rows else 0  # the +Inf bucket counts every 429
        if total <= 0:
            continue
        bound = next(le for le, n in rows if n >= quantile * total)
        out[path] = {"rejected": total, f"p{round(100 * quantile)}_bound_s": bound}
    return out


def rss_growth(samples: Mapping[str, Sequence[tuple[float, int]]], duration_s: float,
               warmup_share: float = WARMUP_SHARE) -> JsonDict:
    """Memory growth per gateway from ``(seconds since the first send, RSS bytes)``
    samples: ``growth`` is the worst gateway's largest sample after warm-up over its last
    sample in warm-up, minus one (NaN when a gateway has no sample on either side)."""
    warm = warmup_share * duration_s
    per: JsonDict = {}
    worst = -math.inf
    for name, xs in samples.items():
        before = [b for t, b in xs if t <= warm]
        after = [b for t, b in xs if t > warm]
        if not before or not after:
            per[name] = {"warm_bytes": None, "peak_bytes": None, "growth": math.nan}
            continue
        g = max(after) / before[-1] - 1.0
        per[name] = {"warm_bytes": before[-1], "peak_bytes": max(after), "growth": g}
        worst = max(worst, g)
    return {"growth": worst if per and worst > -math.inf else math.nan,
            "gateways": per, "warmup_s": warm}


def _pct(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.2f}%"


def _secs(x: float) -> str:
    return f"{1000 * x:g} ms" if x < 1 else f"{x:g} s"


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None or math.isnan(x) else format(x, fmt)


def markdown(section: Mapping[str, Any], time_scale: float, max_output_tokens: int,
             target: float, title: str = "Overload") -> list[str]:
    """The overload part of docs/results/reliability.md: one row per load and rule, then
    a reading of each against ``target`` (the share of admitted requests within SLO the
    issue asks for on this host)."""
    cap = section["capacity"]
    lines = [
        f"## {title}",
        "",
        f"Each row replays the bundled conversation trace's first {section['requests']} "
        f"requests (a fresh token salt, at most {max_output_tokens} output tokens) through "
        "the gateway Service at a multiple of the example's **effective capacity**: "
        f"{cap['speed']:.3f}× the trace's rate, the highest speed at which ≥ 90% of all "
        "requests meet both SLOs in the simulator on the same requests "
        f"(`{cap['command']}`; {_pct(cap.get('rejected_work_share'))} of the work rejected "
        f"there). On the wall clock the engines run at time scale {time_scale:g}. SLOs: TTFT "
        f"{section['ttft_slo_s']:g} s, TBT {1000 * section['tbt_slo_s']:g} ms (the example's). "
        "*prediction* is the paper's rule (the default); *margin* adds "
        "`spec.conductor.ttftMissRisk` (admit only with at most that chance of a TTFT miss, "
        "from the error the gateway measures)."
        + (f" Arrivals are spread within the trace's {section['spread_ms'] / 1000:g} s "
           "rounding step (uniformly, seed 0); the capacity is the unspread trace's."
           if section.get("spread_ms") else
           " Arrivals as the trace rounds them: groups of requests sent at one instant.")
        + (f" {section['gateways']} gateway(s) serve." if section.get("gateways", 2) != 2
           else ""),
        "",
        "| load | admission | requests | rejected (429) | failed | admitted within SLO | "
        "within TTFT | within TBT | TTFT p50 / p99 | TBT p99 | 429 answer p50 / p99 / max "
        "| gateway RSS growth | in flight, most |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for r in section["rows"]:
        rule = r["rule"] + (f" ({r['ttft_miss_risk']:g})" if r.get("ttft_miss_risk") else "")
        if "run_error" in r:
            lines.append(f"| {r['factor']:g}× | {rule} | run failed: {r['run_error']} |"
                         + " |" * 10)
            continue
        lines.append(
            f"| {r['factor']:g}× | {rule} | {r['requests']} | {r['rejected']} | {r['failed']} "
            f"| **{_pct(r['admitted_within_slo'])}** | {_pct(r['within_ttft'])} | "
            f"{_pct(r['within_tbt'])} | {_num(r['ttft_p50_s'], '.1f')} / "
            f"{_num(r['ttft_p99_s'], '.1f')} s | {_num(r['tbt_p99_ms'], '.0f')} ms | "
            f"{_num(r['reject_ms_p50'], '.0f')} / {_num(r['reject_ms_p99'], '.0f')} / "
            f"{_num(r['reject_ms_max'], '.0f')} ms | {r['memory']['growth']:+.1%} | "
            f"{r['inflight_max']} |")
    lines += ["", *reading(section, target), ""]
    return lines


def reading(section: Mapping[str, Any], target: float) -> list[str]:
    """One line per row: met or missed ``target``, and what the misses were."""
    out = []
    for r in section["rows"]:
        if "run_error" in r:
            continue
        rule = r["rule"]
        share = r["admitted_within_slo"]
        verdict = "meets" if share >= target else "**misses**"
        why = []
        if r["within_ttft"] < 1:
            why.append(f"TTFT {_pct(1 - r['within_ttft'])} of the admitted")
        if r["within_tbt"] < 1:
            why.append(f"TBT {_pct(1 - r['within_tbt'])}")
        if r["failed"]:
            why.append(f"{r['failed']} failed")
        rej = ", ".join(f"{k} ×{v}" for k, v in (r.get("rejected_by") or {}).items())
        own = "; ".join(f"{path}: {t['rejected']}, p99 within {_secs(t['p99_bound_s'])}"
                        for path, t in (r.get("gateway_rejection_s") or {}).items())
        pp = r.get("prefill_predictions") or {}
        seen = (f" Admission predicted the admitted prefills' answers "
                f"{pp['predicted_mean_s']:.1f} s after placement on average; they came after "
                f"{pp['answered_mean_s']:.1f} s (measured / predicted p50 "
                f"{pp['ratio_p50']:.2f}, p90 {pp['ratio_p90']:.2f}; "
                f"{_pct(pp['late_share'])} more than {LATE_RATIO:g}× late)."
                if pp.get("answered") else "")
        out.append(
            f"- {r['factor']:g}×, {rule}: {verdict} {_pct(target)} ({_pct(share)} of "
            f"{r['admitted']} admitted within both SLOs"
            + (f"; missed on {', '.join(why)}" if why else "") + "). 429s by reason: "
            + (rej or "none") + "."
            + (f" The gateways' own time to them: {own}." if own else "") + seen)
    return out
