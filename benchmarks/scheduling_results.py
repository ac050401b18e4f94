"""Scheduling results in one run: every design against the Conductor, side by side, with
the realism a skeptical reader asks for (prediction error sigma 0.2, NIC contention, 100 ms
event lag; rejected requests charged the TTFT SLO).

    python benchmarks/scheduling_results.py [--requests 3000] [--loads 0.8,1.1]
        [--seeds 1,2] [--policies a,b,...] [--capacity-policies a,b,...] [--skip capacity,...]
        [--json OUT.json] [--markdown OUT.md]

Sections (each can be skipped with ``--skip``):

- ``tables``: the bundled Mooncake conversation trace and three synthetic shapes (named
  after the paper's Table 2 workloads) at 80% and 110% cold-prefill load; a
  *full-system* table (each design with its own capabilities: fetch, CPP, admission,
  replication) and an *equal-capability* table (``routing_only``: local caches only, no
  CPP, no admission, no replication). Ratios are the best other policy's charged mean
  TTFT over ``conductor``'s (> 1.10 is the issue's target), SLO attainment against
  every other, ``conductor``'s token hit ratio as a share of the reuse ceiling of the
  requests it served, and every design's charged mean TTFT over the TTFT lower bound
  (:mod:`mooncake_sim.bound`; goal: conductor within 1.25x at 80% load), with where
  conductor's excess goes (wait, prefill beyond the ideal, rejections).
- ``offered``: the full-system tables' settings with every design offered overload
  shedding, work stealing and holding (``--capabilities equal``; conductor has them by
  default), so the ratio no longer counts capabilities only conductor was given.
- ``seeds``: the full-system table's ratio again with other seeds (``--seeds``: the
  Conductor's random draws and every request's prediction error drawn anew), so a margin
  is read against its spread from one draw to the next.
- ``exact``: the full-system tables' settings again with exact predictions (prediction
  error 0): ``conductor`` against that run's best other and ``mooncake-paper``, so a
  margin reads as scheduling (it stays) or robustness to wrong predictions (it goes).
- ``pools``: the full-system comparison on smaller and larger pools (4, 8 and 32 prefill
  instances, as many decode) at the same loads, the strongest designs only, and
  ``conductor`` with ``cpp.max_group`` 2 beside its defaults: whether the 16-instance
  picture holds at a size a reader may run.
- ``heldout``: workloads no default was chosen on (``shared-doc``, ``long-output``, and the
  three synthetic shapes drawn from another seed) on 4, 8 and 16 prefill instances:
  ``conductor`` against its earlier CPP defaults and against both readings of
  ``mooncake-paper`` (CPP from 8,192 or 2,048 new tokens).
- ``capacity``: effective request capacity on the conversation trace (``mooncake-operator
  capacity``, every design offered shedding, stealing and holding), against the upper
  bound at the target, with the share of work rejected at capacity; ``mooncake-paper``
  with its own capabilities and conductor without shedding beside it.
- ``calibration``: hardware 25% slower than the model, with and without online
  calibration, against a Conductor told the truth: the prediction error per 200 prefills
  and the TTFT ratio.
- ``hot``: a skewed workload (``shared-doc``: a few long shared documents), hot-prefix
  replication on against off, p90/p99 TTFT.
- ``long``: prompts of at least 64k tokens on the conversation trace, CPP on against off.
- ``decode``: a decode-bound workload (``long-output``: long answers, 4 decode
  instances), conductor's look-ahead decode selector against ``tbt-slo`` and the others,
  and conductor without holding (requests refused for decode room rejected at once).
- ``ablation``: conductor on the conversation trace with one part turned off at a time.
- ``speed``: wall time of one whole-trace replay in a fresh process, start-up included.

Every section prints as it goes (a progress bar on a terminal, plain lines in logs) and
the run ends with a summary that says which targets are met and which are not. With
``--merge EARLIER.json`` the sections run replace that run's, the others are kept, and
the report says which run each section comes from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from mooncake_conductor.policies import policy_names
from mooncake_sim.bound import bounds_for, loss_split, served_reuse_ceiling, ttft_lower_bound
from mooncake_sim.capacity import compute_bound_speed
from mooncake_sim.engine import SimConfig, simulate
from mooncake_sim.presets import PRESETS, speed_for_utilization
from mooncake_sim.synth import PAPER_SHAPES, generate
from mooncake_sim.trace import TraceRecord, bundled_trace, load_trace, trace_stats

PRESET = PRESETS["paper-fig5"]
CONVERSATION = "mooncake-conversation"
DEFAULT_POLICIES = ("least-load,sglang-cache-aware,sglang-cache-aware+,dynamo-kv,llm-d,"
                    "llm-d-precise,aibrix-prefix-cache,kvcache-centric,mooncake-paper,conductor")
DEFAULT_CAPACITY = "sglang-cache-aware+,dynamo-kv,llm-d-precise,mooncake-paper,conductor"
#: the pools section: prefill instances (as many decode) besides the preset's 16, the
#: designs compared there (the best others of the 16-instance tables), and conductor
#: variants shown beside its defaults (not counted as "others")
POOL_SIZES = (4, 8, 32)
POOL_POLICIES = ("dynamo-kv", "llm-d", "kvcache-centric", "mooncake-paper", "conductor")
POOL_VARIANTS: dict[str, dict[str, Any]] = {
    "conductor, max_group 2": {"conductor_params": {"cpp": {"max_group": 2}}},
}
SECTIONS = ("tables", "offered", "seeds", "exact", "pools", "heldout", "capacity",
            "calibration", "hot", "long", "decode", "ablation", "speed")
#: the heldout section: workloads no default was chosen on (two other shapes, and the
#: tables' three shapes drawn from another seed), on 4, 8 and 16 prefill instances
HELDOUT_SHAPES = ("shared-doc", "long-output", *PAPER_SHAPES)
HELDOUT_SEED = 101
HELDOUT_SIZES = (4, 8, 16)
#: conductor with the CPP and work-price defaults it had before they were chosen on the
#: tables' workloads, and mooncake-paper with the CPP threshold that serves it best there
HELDOUT_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "conductor": ("conductor", {}),
    "conductor, earlier CPP defaults": ("conductor", {"conductor_params": {
        "spread_price": False,
        "cpp": {"min_new_tokens": 8192, "opportunistic_staggered": False}}}),
    "mooncake-paper": ("mooncake-paper", {}),
    "mooncake-paper, cpp.min_new_tokens 2048": ("mooncake-paper", {"conductor_params": {
        "cpp": {"min_new_tokens": 2048}}}),
}
#: the decode-bound setting: long answers on a quarter of the preset's decode pool
DECODE_POOL = 4
DECODE_POLICIES = ("dynamo-kv", "llm-d", "kvcache-centric", "mooncake-paper", "conductor")
#: conductor with one thing changed (``ConductorConfig`` fields; ``params`` for the policy)
ABLATION: dict[str, dict[str, Any]] = {
    "conductor (defaults)": {},
    "shortest-job-first queues (priority_weight 2)": {"params": {"priority_weight": 2.0}},
    "no work price (work_weight 0)": {"params": {"work_weight": 0.0}},
    "no CPP": {"params": {"cpp": {"enabled": False}}},
    "CPP groups do not pay for the arrivals they shut out": {"params": {"shut_out_price": False}},
    "one-instance choices do not pay for the arrivals they shut out (placement_shut_out false)":
        {"params": {"placement_shut_out": False}},
    "SLO rescues take idle instances only (rescue_staggered false)":
        {"params": {"cpp": {"rescue_staggered": False}}},
    "other CPP groups take idle instances only (opportunistic_staggered false)":
        {"params": {"cpp": {"opportunistic_staggered": False}}},
    "CPP from 8,192 new tokens (min_new_tokens 8192, the earlier default)":
        {"params": {"cpp": {"min_new_tokens": 8192}}},
    "work priced as if prefill times were exponential (spread_price false)":
        {"params": {"spread_price": False}},
    "no in-flight prefixes (include_pending false)": {"params": {"include_pending": False}},
    "copy instead of migrate on fetch": {"params": {"migrate_on_fetch": False}},
    "transfer not overlapped": {"params": {"overlap_transfer": False}},
    "deterministic ties (tie_tolerance 0)": {"params": {"tie_tolerance": 0.0}},
    "no online calibration": {"calibrate": False},
    "no overrun re-estimation (a prefill past its predicted end counts as done)":
        {"overrun": {"enabled": False}},
    "no hot-prefix replication": {"replicate": False},
    "no overload shedding": {"shedding": {"enabled": False}},
    "no work stealing": {"stealing": {"enabled": False}},
    "no admission": {"admission": False},
    "routing only": {"routing_only": True},
}
SYNTH_SEED = 11
#: the issue's targets
TTFT_MARGIN = 1.10
CAPACITY_MARGIN = 1.10
#: the capacity searches' relative bracket: well under the margin's 10%, so that a ratio
#: near it is not an artefact of where each search stopped (``capacity``'s default is 2%)
CAPACITY_TOLERANCE = 0.002
HIT_OF_CEILING = 0.95
#: conductor's charged mean TTFT over the TTFT lower bound, at BOUND_LOAD
BOUND_GOAL = 1.25
BOUND_LOAD = 0.8
#: what conductor has on by default and the other designs do not (the full-system tables)
CONDUCTOR_EXTRAS = ("overload shedding, work stealing, holding, hot-prefix replication, "
                    "online calibration and overrun re-estimation")
CALIBRATED_ERROR = 0.10
CALIBRATED_TTFT = 1.05
BIAS = 0.25
#: fresh-process replays per policy in the speed section (the fastest is reported)
SPEED_REPEATS = 3
ORACLE = "model told the truth"
SPEED_TARGET_S = 2.0


# -- running -----------------------------------------------------------------------------------
class Progress:
    """A bar on a terminal, a plain line per finished job in a log."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        el = time.perf_counter() - self.started
        if self.tty:
            width = 30
            fill = int(width * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] "
                             f"{self.done}/{self.total} {el:6.0f} s  {what[:40]:40}")
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(f"{self.label} [{self.done}/{self.total}] {what} ({el:.0f} s)\n")
        sys.stderr.flush()


def _run(job: tuple[str, list[TraceRecord], SimConfig]) -> tuple[str, dict[str, Any]]:
    key, records, cfg = job
    return key, simulate(records, cfg)


def run_all(label: str, jobs: list[tuple[str, list[TraceRecord], SimConfig]],
            workers: int) -> dict[str, dict[str, Any]]:
    """Results keyed as the jobs are, in the jobs' order (so every table lists its rows
    the same way run after run, whichever finished first)."""
    bar = Progress(label, len(jobs))
    done: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run, j) for j in jobs]
        for fut in as_completed(futures):
            key, r = fut.result()
            done[key] = r
            bar.step(key)
    return {key: done[key] for key, _, _ in jobs}


def sim_config(policy: str, speed: float, *, routing_only: bool = False,
               **overrides: Any) -> SimConfig:
    """The paper-fig5 preset with its realism; ``overrides`` go to SimConfig, and the
    ``conductor_*`` ones to the ConductorConfig."""
    cond = {k.removeprefix("conductor_"): v for k, v in overrides.items()
            if k.startswith("conductor_")}
    sim = {k: v for k, v in overrides.items() if not k.startswith("conductor_")}
    return PRESET.sim_config(policy, speed, conductor={"routing_only": routing_only, **cond},
                             **sim)


def workload(name: str, requests: int) -> list[TraceRecord]:
    if name == CONVERSATION:
        return load_trace(bundled_trace())
    return generate(name.removeprefix("synth-"), requests, seed=SYNTH_SEED)


Variant = tuple[str, str, dict[str, Any]]  # (name, policy, sim_config keyword arguments)


def sweep(args: argparse.Namespace, label: str, recs: list[TraceRecord],
          variants: list[Variant], speed_at: Any = None) -> dict[str, dict[str, Any]]:
    """Every variant at every load of ``--loads``, keyed ``"load|name"``; ``speed_at(load)``
    is the replay speed (default: that share of the pool's cold-prefill capacity)."""
    jobs = []
    for load in args.loads:
        speed = (speed_at(load) if speed_at is not None
                 else speed_for_utilization(recs, PRESET.prefill, load))
        for name, pol, kw in variants:
            jobs.append((f"{load}|{name}", recs, sim_config(pol, speed, **kw)))
    return run_all(label, jobs, args.jobs)


# -- sections ----------------------------------------------------------------------------------
def table_workloads(requests: int) -> dict[str, list[TraceRecord]]:
    """The workloads of the tables and the seeds section: the bundled trace, then each of
    the paper's shapes."""
    names = [CONVERSATION, *(f"synth-{s}" for s in PAPER_SHAPES)]
    return {n: workload(n, requests) for n in names}


def tables(args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    loads = args.loads
    data = table_workloads(args.requests)
    ceilings = {n: trace_stats(r).reuse_ceiling_tokens for n, r in data.items()}
    # the TTFT lower bound of each workload and mode: one for every design of the table
    # (CPP as far as any of them may form it; none in routing-only); load does not enter
    bounds = {(n, mode): bounds_for(recs, [sim_config(pol, 1.0,
                                                      routing_only=mode == "routing-only")
                                           for pol in policies])
              for n, recs in data.items() for mode in ("full", "routing-only")}
    jobs = []
    for n, recs in data.items():
        for load in loads:
            speed = speed_for_utilization(recs, PRESET.prefill, load)
            for mode in ("full", "routing-only"):
                for pol in policies:
                    jobs.append((f"{n}|{load}|{mode}|{pol}", recs,
                                 sim_config(pol, speed, routing_only=mode == "routing-only")))
    res = run_all("tables", jobs, args.jobs)
    runs = []
    for n in data:
        for load in loads:
            for mode in ("full", "routing-only"):
                rows = {p: res[f"{n}|{load}|{mode}|{p}"] for p in policies}
                runs.append(_compare(n, load, mode, rows, ceilings[n], data[n],
                                     bounds[(n, mode)]))
    return {"workloads": {n: {"requests": len(r), "reuse_ceiling": ceilings[n]}
                          for n, r in data.items()}, "runs": runs}


#: what ``offered`` turns on for every design (``--capabilities equal``)
OFFERED: dict[str, Any] = {"conductor_shedding": {"enabled": True},
                           "conductor_stealing": {"enabled": True},
                           "conductor_holding": {"enabled": True}}


def offered(args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    """The full-system tables' settings, every design offered overload shedding, work
    stealing and holding (those without admission can use stealing only)."""
    data = table_workloads(args.requests)
    bounds = {n: bounds_for(recs, [sim_config(p, 1.0) for p in policies])
              for n, recs in data.items()}
    jobs = []
    for n, recs in data.items():
        for load in args.loads:
            speed = speed_for_utilization(recs, PRESET.prefill, load)
            for pol in policies:
                jobs.append((f"{n}|{load}|{pol}", recs, sim_config(pol, speed, **OFFERED)))
    res = run_all("offered", jobs, args.jobs)
    runs = []
    for n in data:
        for load in args.loads:
            rows = {p: res[f"{n}|{load}|{p}"] for p in policies}
            runs.append(_compare(n, load, "offered", rows, 0.0, data[n], bounds[n]))
    return {"runs": runs}


def seeds(args: argparse.Namespace, policies: list[str],
          base: dict[str, Any] | None) -> dict[str, Any]:
    """The full-system comparison at every workload and load again with each seed of
    ``--seeds``; with the tables' own run (seed 0) when ``base`` has it."""
    data = table_workloads(args.requests)
    jobs = []
    for n, recs in data.items():
        for load in args.loads:
            speed = speed_for_utilization(recs, PRESET.prefill, load)
            for seed in args.seeds:
                for pol in policies:
                    jobs.append((f"{n}|{load}|{seed}|{pol}", recs,
                                 sim_config(pol, speed, conductor_seed=seed)))
    res = run_all("seeds", jobs, args.jobs)
    earlier = {(r["workload"], r["load"]): r for r in (base or {}).get("runs", [])
               if r["mode"] == "full" and "ttft_ratio" in r}
    runs = []
    for n in data:
        for load in args.loads:
            per_seed: dict[str, Any] = {}
            if (n, load) in earlier:
                per_seed["0"] = _seed_row(earlier[(n, load)])
            for seed in args.seeds:
                rows = {p: res[f"{n}|{load}|{seed}|{p}"] for p in policies}
                per_seed[str(seed)] = _seed_row(_compare(n, load, "full", rows, 0.0))
            ratios = [r["ttft_ratio"] for r in per_seed.values() if "ttft_ratio" in r]
            runs.append({"workload": n, "load": load, "seeds": per_seed,
                         "ttft_ratio_mean": sum(ratios) / len(ratios) if ratios else math.nan,
                         "ttft_ratio_min": min(ratios, default=math.nan)})
    return {"seeds": [0, *args.seeds] if earlier else list(args.seeds), "runs": runs}


def exact(args: argparse.Namespace, base: dict[str, Any] | None) -> dict[str, Any]:
    """Every full-system setting of the tables with prediction error 0 (everything else as
    there): ``conductor``, the tables' best other at that setting, and ``mooncake-paper``.
    The ratio is against the better of the others as they run here."""
    data = table_workloads(args.requests)
    noisy = {(r["workload"], r["load"]): r for r in (base or {}).get("runs", [])
             if r["mode"] == "full" and "ttft_ratio" in r}
    jobs, rivals = [], {}
    for n, recs in data.items():
        for load in args.loads:
            speed = speed_for_utilization(recs, PRESET.prefill, load)
            earlier = noisy.get((n, load))
            rivals[(n, load)] = list(dict.fromkeys(
                ([earlier["best_other"]] if earlier else []) + ["mooncake-paper"]))
            for pol in ("conductor", *rivals[(n, load)]):
                jobs.append((f"{n}|{load}|{pol}", recs,
                             sim_config(pol, speed, prediction_error=0.0)))
    res = run_all("exact predictions", jobs, args.jobs)
    runs = []
    for n in data:
        for load in args.loads:
            rows = {p: res[f"{n}|{load}|{p}"]
                    for p in ("conductor", *rivals[(n, load)])}
            run = _compare(n, load, "full", rows, 0.0)
            earlier = noisy.get((n, load))
            run["noisy_ttft_ratio"] = earlier["ttft_ratio"] if earlier else math.nan
            runs.append(run)
    return {"runs": runs}


def pools(args: argparse.Namespace) -> dict[str, Any]:
    """The full-system comparison at each of ``POOL_SIZES`` (the loads scaled to the pool),
    the conductor variants of ``POOL_VARIANTS`` beside it."""
    data = table_workloads(args.requests)
    names = [*POOL_POLICIES, *POOL_VARIANTS]
    jobs = []
    for size in POOL_SIZES:
        for n, recs in data.items():
            for load in args.loads:
                speed = speed_for_utilization(recs, size, load)
                for name in names:
                    pol, kw = (name, {}) if name in POOL_POLICIES else ("conductor",
                                                                          POOL_VARIANTS[name])
                    jobs.append((f"{size}|{n}|{load}|{name}", recs,
                                 sim_config(pol, speed, prefill=size, decode=size, **kw)))
    res = run_all("pools", jobs, args.jobs)
    runs = []
    for size in POOL_SIZES:
        for n in data:
            for load in args.loads:
                rows = {p: res[f"{size}|{n}|{load}|{p}"] for p in POOL_POLICIES}
                run = _compare(n, load, "full", rows, 0.0)
                run.pop("hit_of_ceiling", None)
                run["prefill"] = size
                run["variants"] = {}
                for v in POOL_VARIANTS:
                    r = res[f"{size}|{n}|{load}|{v}"]
                    best = run["results"][run["best_other"]]["ttft_mean_charged_s"]
                    run["variants"][v] = {
                        "ttft_mean_charged_s": r["ttft_mean_charged_s"],
                        "slo_attainment": r["slo_attainment"], "rejected": r["rejected"],
                        "ttft_ratio": best / r["ttft_mean_charged_s"]}
                runs.append(run)
    return {"sizes": list(POOL_SIZES), "policies": list(POOL_POLICIES),
            "variants": list(POOL_VARIANTS), "runs": runs}


def heldout(args: argparse.Namespace) -> dict[str, Any]:
    """conductor, its earlier CPP defaults and both readings of mooncake-paper on workloads
    no default was chosen on; ratios per run and their geometric means."""
    data = {f"synth-{n}@{HELDOUT_SEED}": generate(n, args.requests, seed=HELDOUT_SEED)
            for n in HELDOUT_SHAPES}
    jobs = []
    for size in HELDOUT_SIZES:
        for n, recs in data.items():
            for load in args.loads:
                speed = speed_for_utilization(recs, size, load)
                for name, (pol, kw) in HELDOUT_VARIANTS.items():
                    jobs.append((f"{size}|{n}|{load}|{name}", recs,
                                 sim_config(pol, speed, prefill=size, decode=size, **kw)))
    res = run_all("heldout", jobs, args.jobs)
    keep = ("ttft_mean_charged_s", "slo_attainment", "rejected", "token_hit_ratio")
    runs = []
    for size in HELDOUT_SIZES:
        for n in data:
            for load in args.loads:
                rows = {v: {k: res[f"{size}|{n}|{load}|{v}"][k] for k in keep}
                        for v in HELDOUT_VARIANTS}
                ttft = {v: r["ttft_mean_charged_s"] for v, r in rows.items()}
                paper = min(ttft["mooncake-paper"], ttft["mooncake-paper, cpp.min_new_tokens 2048"])
                runs.append({"prefill": size, "workload": n, "load": load, "results": rows,
                             "vs_earlier": ttft["conductor, earlier CPP defaults"]
                             / ttft["conductor"],
                             "vs_paper": paper / ttft["conductor"]})
    return {"seed": HELDOUT_SEED, "sizes": list(HELDOUT_SIZES), "runs": runs,
            "geomean_vs_earlier": _geomean([r["vs_earlier"] for r in runs]),
            "geomean_vs_paper": _geomean([r["vs_paper"] for r in runs])}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def _seed_row(run: dict[str, Any]) -> dict[str, Any]:
    """What the seeds section keeps of one :func:`_compare` result."""
    return {k: run[k] for k in ("best_other", "ttft_ratio", "best_slo_other", "slo_margin")
            if k in run}


def _compare(name: str, load: float, mode: str, rows: dict[str, dict[str, Any]],
             ceiling: float, records: list[TraceRecord] | None = None,
             bounds: list[float] | None = None) -> dict[str, Any]:
    """One table: the rows, conductor against the best other; with ``records``, the hit
    ratio against the served requests' ceiling, and with ``bounds`` (per request), every
    row's charged TTFT over the TTFT lower bound and where conductor's excess goes."""
    keep = ("ttft_mean_charged_s", "ttft_mean_s", "prefill_exec_mean_s", "ttft_wait_mean_s",
            "ttft_p90_s", "ttft_p99_s", "tbt_p90_ms", "slo_attainment", "token_hit_ratio",
            "rejected", "wall_seconds")
    out: dict[str, Any] = {"workload": name, "load": load, "mode": mode,
                           "results": {p: {k: r[k] for k in keep} for p, r in rows.items()}}
    slo = PRESET.ttft_slo_s
    if bounds is not None:
        bound = ttft_lower_bound(bounds, slo)
        out["ttft_lower_bound_s"] = bound
        for p, r in rows.items():
            out["results"][p]["ttft_over_bound"] = r["ttft_mean_charged_s"] / bound
        if "conductor" in rows:
            out["conductor_excess_s"] = loss_split(rows["conductor"], bounds, slo)
    c = rows.get("conductor")
    others = {p: r for p, r in rows.items() if p != "conductor"}
    if c and others:
        best = min(others, key=lambda p: others[p]["ttft_mean_charged_s"])
        out["best_other"] = best
        out["ttft_ratio"] = others[best]["ttft_mean_charged_s"] / c["ttft_mean_charged_s"]
        top = max(others, key=lambda p: others[p]["slo_attainment"])
        out["best_slo_other"] = top
        out["slo_margin"] = c["slo_attainment"] - others[top]["slo_attainment"]
        if records is not None:  # the ceiling of what the hit ratio measures: the served
            ceiling = served_reuse_ceiling(records, c["rejected_ids"])
            out["served_reuse_ceiling"] = ceiling
        out["hit_of_ceiling"] = c["token_hit_ratio"] / ceiling if ceiling else math.nan
    return out


def _capacity_cli(args: argparse.Namespace, policies: str, *flags: str) -> dict[str, Any]:
    """``mooncake-operator capacity`` on the preset, its JSON rows by policy."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "capacity.json"
        cmd = [sys.executable, "-m", "mooncake_cli", "capacity", "--preset", "paper-fig5",
               "--policy", policies, "--tolerance", str(CAPACITY_TOLERANCE), *flags,
               "--json", str(out), "--jobs", str(args.jobs)]
        print("capacity: " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        doc = json.loads(out.read_text())
    return {r["policy"]: r for r in doc["results"]}


#: designs whose own capabilities differ from the equal reading in a way that matters
#: (admission without conductor's shedding and holding): shown with their own too
CAPACITY_OWN = ("kvcache-centric", "mooncake-paper")


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Every design offered shedding, stealing and holding (``capacity``'s default); the
    admission designs also with their own capabilities, and conductor without shedding."""
    rows = _capacity_cli(args, args.capacity_policies)
    keep = ("capacity_speed", "limit_target_speed", "of_bound", "rejected_work_share",
            "bracketed")
    out_doc: dict[str, Any] = {"capabilities": "equal", "results": {
        p: {k: r[k] for k in keep} for p, r in rows.items()}}
    own = [p for p in CAPACITY_OWN if p in rows]
    if own:
        own_rows = _capacity_cli(args, ",".join(own), "--capabilities", "own")
        out_doc["own_capabilities"] = {p: {k: r[k] for k in keep} for p, r in own_rows.items()}
    if "conductor" in rows:
        others = {p: r for p, r in rows.items() if p != "conductor"}
        if others:
            best = max(others, key=lambda p: others[p]["capacity_speed"])
            out_doc["best_other"] = best
            out_doc["ratio_to_best"] = (rows["conductor"]["capacity_speed"]
                                        / others[best]["capacity_speed"])
        out_doc["of_bound"] = rows["conductor"]["of_bound"]
        unshed = _capacity_cli(args, "conductor", "--no-shedding")
        out_doc["without_shedding"] = unshed["conductor"]["capacity_speed"]
    return out_doc


def calibration(args: argparse.Namespace) -> dict[str, Any]:
    """The hardware is 25% slower than the configured model (``model_bias``) in every run;
    the reference is a Conductor told the truth from the start (prefill scale 1.25, no
    learning), so a TTFT ratio near 1 means calibration recovered what the model lost."""
    recs = workload(CONVERSATION, args.requests)
    speed = speed_for_utilization(recs, PRESET.prefill, PRESET.target_utilization)
    told = {"initial_scale": 1.0 + BIAS}
    jobs = [(ORACLE, recs, sim_config("conductor", speed, model_bias=BIAS,
                                      conductor_calibrate=False, conductor_calibration=told)),
            ("calibrated", recs, sim_config("conductor", speed, model_bias=BIAS)),
            ("not calibrated", recs,
             sim_config("conductor", speed, model_bias=BIAS, conductor_calibrate=False))]
    res = run_all("calibration", jobs, args.jobs)
    base = res[ORACLE]["ttft_mean_charged_s"]
    out: dict[str, Any] = {"bias": BIAS, "runs": {}}
    for k, r in res.items():
        windows = r["prediction_error_windows"]
        settled = next((i for i, e in enumerate(windows) if e < CALIBRATED_ERROR), None)
        out["runs"][k] = {
            "ttft_mean_charged_s": r["ttft_mean_charged_s"],
            "ttft_vs_told": r["ttft_mean_charged_s"] / base,
            "slo_attainment": r["slo_attainment"],
            "prefill_scale": r["prefill_scale"],
            "error_windows_first": windows[:5],
            "error_windows_mean_after_first": (sum(windows[1:]) / len(windows[1:])
                                               if len(windows) > 1 else math.nan),
            "first_window_under_10pct": settled,
        }
    return out


def hot(args: argparse.Namespace) -> dict[str, Any]:
    recs = workload("synth-shared-doc", args.requests)
    # 92% of this workload is reusable: loaded on its cold prefills it would idle the pool,
    # so its loads are shares of the ideal-reuse compute limit (the work that must be done)
    limit = compute_bound_speed(recs, PRESET.prefill)
    res = sweep(args, "hot prefix", recs,
                [(on, "conductor", {"conductor_replicate": on == "on"}) for on in ("on", "off")],
                speed_at=lambda load: load * limit)
    keep = ("ttft_mean_charged_s", "ttft_p90_s", "ttft_p99_s", "slo_attainment",
            "token_hit_ratio", "replicated_tokens")
    return {"workload": "synth-shared-doc", "requests": len(recs),
            "reuse_ceiling": trace_stats(recs).reuse_ceiling_tokens,
            "runs": {k: {x: r[x] for x in keep} for k, r in res.items()}}


def long_prompts(args: argparse.Namespace) -> dict[str, Any]:
    recs = workload(CONVERSATION, args.requests)
    res = sweep(args, "long prompts", recs, [
        (f"{pol}|{on}", pol, {"conductor_params": {"cpp": {"enabled": on == "on"}}})
        for pol in ("conductor", "mooncake-paper") for on in ("on", "off")])
    return {"runs": {k: {"long": r["long_prompts"], "slo_attainment": r["slo_attainment"],
                         "ttft_mean_charged_s": r["ttft_mean_charged_s"]}
                     for k, r in res.items()}}


def decode_bound(args: argparse.Namespace) -> dict[str, Any]:
    """Long answers on 4 decode instances: the decode pool saturates first. ``conductor``
    with its look-ahead decode selector against the same policy on the paper's
    ``tbt-slo`` and the other designs."""
    recs = workload("synth-long-output", args.requests)
    variants: list[Variant] = [(p, p, {"decode": DECODE_POOL}) for p in DECODE_POLICIES]
    variants.append(("conductor, tbt-slo decode", "conductor",
                     {"decode": DECODE_POOL, "conductor_decode_selector": "tbt-slo"}))
    variants.append(("conductor, no holding", "conductor",
                     {"decode": DECODE_POOL, "conductor_holding": {"enabled": False}}))
    res = sweep(args, "decode-bound", recs, variants)
    keep = ("ttft_mean_charged_s", "ttft_mean_s", "slo_attainment", "tbt_p90_ms",
            "tbt_p99_ms", "rejected", "held")
    return {"workload": "synth-long-output", "requests": len(recs), "decode": DECODE_POOL,
            "runs": {k: {x: r[x] for x in keep} for k, r in res.items()}}


def ablation(args: argparse.Namespace) -> dict[str, Any]:
    """conductor on the conversation trace with one thing turned off at a time."""
    recs = workload(CONVERSATION, args.requests)
    variants: list[Variant] = []
    for name, change in ABLATION.items():
        kw = {f"conductor_{k}": v for k, v in change.items() if k != "routing_only"}
        variants.append((name, "conductor",
                         {**kw, "routing_only": bool(change.get("routing_only"))}))
    res = sweep(args, "ablation", recs, variants)
    keep = ("ttft_mean_charged_s", "ttft_mean_s", "slo_attainment", "rejected",
            "token_hit_ratio", "prefill_gpu_seconds")
    return {"runs": {k: {x: r[x] for x in keep} for k, r in res.items()}}


def speed(args: argparse.Namespace) -> dict[str, Any]:
    """Each policy's whole-trace replay in a fresh process, ``SPEED_REPEATS`` times: the
    fastest is the figure (what the code costs; a slower run measured the host's other
    work), every time is kept."""
    out: dict[str, Any] = {"runs": {}}
    for pol in ("conductor", "random"):
        times = []
        for _ in range(SPEED_REPEATS):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "mooncake_cli", "simulate", "--preset",
                            "paper-fig5", "--policy", pol], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - started)
            print(f"speed: {pol} whole trace in {times[-1]:.2f} s (fresh process)",
                  file=sys.stderr, flush=True)
        out[pol] = min(times)
        out["runs"][pol] = times
    out["load_average"] = os.getloadavg()[0]
    return out


# -- report ------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}%"


def _ratio(x: float) -> str:
    """A ratio as ``1.234x``; ``–`` when there is none (NaN: the tables were skipped)."""
    return "–" if math.isnan(x) else f"{x:.3f}x"


def _table(cols: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """A Markdown table (the ``left`` columns left-aligned, the others right), then a
    blank line."""
    align = "|".join("---" if i in left else "---:" for i in range(len(cols)))
    return ([f"| {' | '.join(cols)} |", f"|{align}|"]
            + [f"| {' | '.join(row)} |" for row in rows] + [""])


def _at_load(key: str) -> str:
    """``"0.8|conductor|on"`` as ``"80%, conductor, on"``."""
    load, *rest = key.split("|")
    return ", ".join([f"{100 * float(load):.0f}%", *rest])


def markdown(doc: dict[str, Any]) -> str:
    runs = doc.get("sections_run")
    when = (f"One run of `benchmarks/scheduling_results.py` ({doc['started']}, "
            if not runs else
            "Sections of `benchmarks/scheduling_results.py` from more than one run ("
            + "; ".join(f"{', '.join(k for k, v in runs.items() if v == at)}: {at}"
                        for at in sorted(set(runs.values()), reverse=True)) + "; ")
    t = doc.get("tables")
    lines = ["# Scheduling results", "",
             f"{when}"
             f"{doc['settings']['cpus']} cores, load average at the end "
             f"{doc['settings']['load_end']:.1f}). paper-fig5 pools (16P+16D, 3M-token local "
             "caches, TTFT SLO 30 s, TBT SLO 100 ms), prediction error sigma 0.2, NIC "
             "contention on, event lag 100 ms. `charged`: mean TTFT over all requests, each "
             "rejected one charged the 30 s SLO. Load: the share of the prefill pool the "
             "trace's cold prefills would fill. Ratio: best other policy's charged TTFT / "
             "conductor's. Served TTFT = `prefill s` (the prefill's own execution, a CPP "
             "group's makespan) + `wait s` (queueing, fetches, decode holds: the part "
             "scheduling controls).", ""]
    if t and "ttft_lower_bound_s" in next(iter(t["runs"]), {}):
        lines += ["`÷ bound`: charged TTFT over the TTFT lower bound (`mooncake_sim.bound`): "
                  "each prompt's prefill compute on the tokens no earlier request could have "
                  "left cached, with CPP over idle instances up to the largest group any "
                  "design of the table may form (none in routing-only), no queueing, no "
                  "fetch or transfer, each rejected request counted at most the SLO. It does "
                  "not depend on load: a bound, not a target. `excess`: conductor's charged "
                  "TTFT above the bound, per request, split into wait, prefill beyond the "
                  "ideal (cache misses, smaller or no CPP groups) and rejections.", ""]
    if t:
        for mode, title in (("full", "Full system (each design's own capabilities)"),
                            ("routing-only", "Equal capability (routing only: local caches, "
                             "no CPP, no admission, no replication)")):
            lines += [f"## {title}", ""]
            if mode == "full":
                lines += [f"Conductor alone runs with {CONDUCTOR_EXTRAS}; the others with "
                          "admission (kvcache-centric, mooncake-paper) have none of them. So "
                          "these ratios include what those extras win; the equal-capability "
                          "tables below, the section where every design is offered "
                          "shedding, stealing and holding, and the capacity section do "
                          "not.", ""]
            for run in (r for r in t["runs"] if r["mode"] == mode):
                w = t["workloads"][run["workload"]]
                lines += [f"### {run['workload']} at {100 * run['load']:.0f}% load "
                          f"({w['requests']} requests, reuse ceiling "
                          f"{100 * w['reuse_ceiling']:.1f}%)", ""]
                lines += _table(
                    ["policy", "charged TTFT s", "÷ bound", "served TTFT s", "prefill s",
                     "wait s", "p90 s", "p99 s", "SLO", "hit", "rejected"],
                    [[p, f"{r['ttft_mean_charged_s']:.3f}",
                      f"{r['ttft_over_bound']:.2f}x" if "ttft_over_bound" in r else "–",
                      f"{r['ttft_mean_s']:.3f}",
                      f"{r['prefill_exec_mean_s']:.3f}", f"{r['ttft_wait_mean_s']:.3f}",
                      f"{r['ttft_p90_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
                      _pct(r["slo_attainment"]), _pct(r["token_hit_ratio"]),
                      str(r["rejected"])] for p, r in run["results"].items()])[:-1]
                if "ttft_ratio" in run:
                    served = ("of the served requests' ceiling "
                              f"({_pct(run['served_reuse_ceiling'])})"
                              if "served_reuse_ceiling" in run else "of ceiling")
                    lines += ["", f"Best other: {run['best_other']}, ratio "
                              f"**{run['ttft_ratio']:.3f}x**; conductor SLO "
                              f"{'≥' if run['slo_margin'] >= 0 else '<'} every other "
                              f"({100 * run['slo_margin']:+.2f} points vs "
                              f"{run['best_slo_other']}); hit "
                              f"{_pct(run['hit_of_ceiling'])} {served}."]
                if "ttft_lower_bound_s" in run:
                    alone = _one_instance_bound(t, run)
                    lines += ["", f"TTFT lower bound {run['ttft_lower_bound_s']:.3f} s"
                              + (f" ({alone:.3f} s with one instance per prompt, the "
                                 "routing-only bound)" if alone is not None else "")
                              + (f"; conductor's excess over it {_excess(run)}"
                                 if "conductor_excess_s" in run else "") + "."]
                lines.append("")
    of = doc.get("offered")
    if of:
        own = {(r["workload"], r["load"]): r for r in (t or {}).get("runs", [])
               if r["mode"] == "full" and "ttft_ratio" in r}
        lines += ["## Full system, every design offered shedding, stealing and holding", "",
                  "The full-system tables' settings with overload shedding, work stealing "
                  "and holding on for every design (`--capabilities equal`; the designs "
                  "without admission can use stealing only). Conductor has all three by "
                  "default; its replication, calibration and overrun re-estimation stay "
                  "its own. Ratio: best other's charged TTFT / conductor's; `own`: the "
                  "same from the tables above; `fair`: the lower of the two (each other "
                  "design with or without the three, whichever serves it better).", ""]
        lines += _table(
            ["workload, load", "best other", "its charged TTFT s", "conductor s", "ratio",
             "ratio, own", "ratio, fair", "SLO vs best other", "conductor ÷ bound"],
            [[f"{r['workload']}, {100 * r['load']:.0f}%", r["best_other"],
              f"{r['results'][r['best_other']]['ttft_mean_charged_s']:.3f}",
              f"{r['results']['conductor']['ttft_mean_charged_s']:.3f}",
              f"**{r['ttft_ratio']:.3f}x**",
              _ratio(own[(r["workload"], r["load"])]["ttft_ratio"])
              if (r["workload"], r["load"]) in own else "–",
              _ratio(_fair_ratio(r, own)),
              f"{100 * r['slo_margin']:+.2f} points",
              f"{r['results']['conductor']['ttft_over_bound']:.2f}x"]
             for r in of["runs"] if "ttft_ratio" in r], left=(0, 1))
    c = doc.get("capacity")
    if c and "of_bound" in next(iter(c["results"].values()), {}):
        own = c.get("own_capabilities", {})
        lines += ["## Effective capacity, conversation trace", "",
                  "Highest replay speed with ≥ 90% of all requests within both SLOs, every "
                  "design offered overload shedding, work stealing and holding (those with "
                  "admission use all three; `capacity`'s default). Bound: the highest speed "
                  "at which the pool could compute the cheapest 90% of the requests with "
                  "ideal reuse, draining within the TTFT SLO (no design can pass it). Work "
                  "rejected: the ideal-reuse prefill seconds of the requests rejected at "
                  f"capacity, as a share of all. Each search stops once its bracket is "
                  f"{100 * CAPACITY_TOLERANCE:g}% wide.", ""]
        lines += _table(["policy", "capacity", "of bound", "work rejected",
                         "own capabilities: capacity"],
                        [[p, f"{r['capacity_speed']:.3g}x", _pct(r["of_bound"]),
                          _pct(r["rejected_work_share"]),
                          f"{own[p]['capacity_speed']:.3g}x" if p in own else "as equal"]
                         for p, r in c["results"].items()])
        if "ratio_to_best" in c:
            conductor = c["results"]["conductor"]
            lines[-1:] = ["", f"conductor / best other ({c['best_other']}): "
                          f"**{c['ratio_to_best']:.3f}x**; conductor at "
                          f"{_pct(c['of_bound'])} of the bound "
                          f"({conductor['limit_target_speed']:.3g}x). Conductor's own "
                          "capabilities are the equal reading's, so the last column changes "
                          "only the others.", ""]
        if c.get("without_shedding"):
            lines[-1:] = ["", f"Without overload shedding the conductor's capacity is "
                          f"{c['without_shedding']:.3g}x (with: "
                          f"{c['results']['conductor']['capacity_speed']:.3g}x).", ""]
    cal = doc.get("calibration")
    if cal:
        lines += [f"## Online calibration: hardware {100 * cal['bias']:.0f}% slower than the "
                  "model (conversation, 80% load)", "",
                  "Every run executes 25% slower than the configured cost model predicts "
                  "(prefill and decode). Reference: a Conductor told the truth (prefill "
                  "scale 1.25 from the start, no learning). Error: the systematic prefill-time "
                  "prediction error per window of 200 prefills.", ""]
        lines += _table(
            ["run", "charged TTFT s", "vs told", "SLO", "learnt scale",
             "error, first windows of 200", "mean after the first"],
            [[k, f"{r['ttft_mean_charged_s']:.3f}", f"{r['ttft_vs_told']:.3f}x",
              _pct(r["slo_attainment"]), f"{r['prefill_scale']:.3f}",
              ", ".join(f"{100 * e:.1f}%" for e in r["error_windows_first"]),
              _pct(r["error_windows_mean_after_first"])] for k, r in cal["runs"].items()],
            left=(0, 5))
    h = doc.get("hot")
    if h:
        lines += [f"## Hot prefixes: replication on vs off ({h['workload']}, "
                  f"{h['requests']} requests, reuse ceiling {100 * h['reuse_ceiling']:.1f}%)",
                  "", "conductor alone. Load: share of the ideal-reuse compute limit (with "
                  "92% reuse, a load on cold prefills would leave the pool idle).", ""]
        lines += _table(
            ["load, replication", "charged TTFT s", "p90 s", "p99 s", "SLO", "hit",
             "copied tokens"],
            [[_at_load(k), f"{r['ttft_mean_charged_s']:.3f}", f"{r['ttft_p90_s']:.2f}",
              f"{r['ttft_p99_s']:.2f}", _pct(r["slo_attainment"]), _pct(r["token_hit_ratio"]),
              f"{r['replicated_tokens']:,}"] for k, r in h["runs"].items()])
    lp = doc.get("long")
    if lp:
        lines += ["## Long prompts (≥ 64k tokens, conversation trace): CPP on vs off", ""]
        lines += _table(
            ["load, policy, CPP", "long prompts", "their SLO", "their charged TTFT s",
             "their p90 s", "all: SLO"],
            [[_at_load(k), str(r["long"]["requests"]), _pct(r["long"]["slo_attainment"]),
              f"{r['long']['ttft_mean_charged_s']:.2f}", f"{r['long']['ttft_p90_s']:.2f}",
              _pct(r["slo_attainment"])] for k, r in lp["runs"].items()])
    dc = doc.get("decode")
    if dc:
        lines += [f"## Decode-bound: long answers on {dc['decode']} decode instances "
                  f"({dc['workload']}, {dc['requests']} requests)", ""]
        lines += _table(
            ["load, policy", "charged TTFT s", "served TTFT s", "SLO", "TBT p90 ms",
             "TBT p99 ms", "rejected", "held"],
            [[_at_load(k), f"{r['ttft_mean_charged_s']:.2f}", f"{r['ttft_mean_s']:.2f}",
              _pct(r["slo_attainment"]), f"{r['tbt_p90_ms']:.0f}", f"{r['tbt_p99_ms']:.0f}",
              str(r["rejected"]), str(r["held"])]
             for k, r in dc["runs"].items()])
    ab = doc.get("ablation")
    if ab:
        lines += ["## What each part of conductor buys (conversation trace)", ""]
        lines += _table(
            ["load, variant", "charged TTFT s", "served TTFT s", "SLO", "rejected", "hit",
             "GPU s"],
            [[_at_load(k), f"{r['ttft_mean_charged_s']:.3f}", f"{r['ttft_mean_s']:.3f}",
              _pct(r["slo_attainment"]), str(r["rejected"]), _pct(r["token_hit_ratio"]),
              f"{r['prefill_gpu_seconds']:,.0f}"] for k, r in ab["runs"].items()])
    sd = doc.get("seeds")
    if sd:
        lines += ["## Full-system TTFT ratio across seeds", "",
                  "Best other policy's charged TTFT / conductor's, each seed a new draw of "
                  "the Conductor's random choices and of every request's prediction error "
                  "(seed 0: the tables above).", ""]
        cols = [str(x) for x in sd["seeds"]]
        lines += _table(
            ["workload, load", *(f"seed {c}" for c in cols), "mean", "lowest",
             "SLO vs best other, lowest"],
            [[f"{r['workload']}, {100 * r['load']:.0f}%",
              *(_seed_cell(r["seeds"].get(c, {})) for c in cols),
              f"{r['ttft_ratio_mean']:.3f}x", f"{r['ttft_ratio_min']:.3f}x",
              _slo_cell(r)] for r in sd["runs"]], left=(0,))
    ex = doc.get("exact")
    if ex:
        lines += ["## The same settings with exact predictions", "",
                  "Prediction error 0, everything else as in the full-system tables: "
                  "conductor against that table's best other and mooncake-paper. A ratio "
                  "that holds here is won by scheduling; the part that goes is won by "
                  "robustness to wrong predictions (σ 0.2 in the tables).", ""]
        lines += _table(
            ["workload, load", "ratio, σ 0.2", "ratio, exact", "best other here",
             "conductor prefill + wait", "best other prefill + wait"],
            [[f"{r['workload']}, {100 * r['load']:.0f}%", _ratio(r["noisy_ttft_ratio"]),
              _ratio(r["ttft_ratio"]), r["best_other"],
              _split(r["results"]["conductor"]), _split(r["results"][r["best_other"]])]
             for r in ex["runs"]], left=(0, 3))
    pl = doc.get("pools")
    if pl:
        lines += ["## Other pool sizes (full system)", "",
                  f"The tables' setting on {', '.join(f'{x}P+{x}D' for x in pl['sizes'])} "
                  "(loads scaled to the pool), the strongest designs only ("
                  + ", ".join(f"`{p}`" for p in pl["policies"] if p != "conductor")
                  + "). Ratio: best other's charged TTFT / conductor's; "
                  + "; ".join(f"`{v}`: the same ratio for that variant" for v in pl["variants"])
                  + ".", ""]
        lines += _table(
            ["pool, workload, load", "best other", "its charged TTFT s", "conductor s",
             "ratio", "SLO vs best other", *(f"{v}: s, ratio" for v in pl["variants"])],
            [[f"{r['prefill']}P, {r['workload']}, {100 * r['load']:.0f}%", r["best_other"],
              f"{r['results'][r['best_other']]['ttft_mean_charged_s']:.3f}",
              f"{r['results']['conductor']['ttft_mean_charged_s']:.3f}",
              f"**{r['ttft_ratio']:.3f}x**", f"{100 * r['slo_margin']:+.2f} points",
              *(f"{x['ttft_mean_charged_s']:.3f}, {x['ttft_ratio']:.3f}x"
                for x in r["variants"].values())] for r in pl["runs"]], left=(0, 1))
    ho = doc.get("heldout")
    if ho:
        lines += ["## Held-out workloads (full system)", "",
                  "Workloads no default was chosen on: `shared-doc` and `long-output`, and the "
                  f"tables' three synthetic shapes drawn with seed {ho['seed']} (the tables "
                  f"use {SYNTH_SEED}), on {', '.join(f'{x}P+{x}D' for x in ho['sizes'])}. "
                  "`earlier`: conductor with the CPP and work-price defaults it had before "
                  "they were chosen on the tables' workloads (CPP from 8,192 new tokens, idle "
                  "members only, no spread price); ratio: its charged TTFT / conductor's. "
                  "`paper`: the better of mooncake-paper's two readings (CPP from 8,192 or "
                  "2,048 new tokens) / conductor's.", ""]
        lines += _table(
            ["pool, workload, load", "conductor s", "earlier s", "ratio",
             "mooncake-paper s", "mooncake-paper 2048 s", "paper ratio", "SLO", "rejected"],
            [[f"{r['prefill']}P, {r['workload']}, {100 * r['load']:.0f}%",
              *(f"{r['results'][v]['ttft_mean_charged_s']:.3f}"
                for v in ("conductor", "conductor, earlier CPP defaults")),
              f"{r['vs_earlier']:.3f}x",
              *(f"{r['results'][v]['ttft_mean_charged_s']:.3f}"
                for v in ("mooncake-paper", "mooncake-paper, cpp.min_new_tokens 2048")),
              f"**{r['vs_paper']:.3f}x**",
              _pct(r["results"]["conductor"]["slo_attainment"]),
              str(r["results"]["conductor"]["rejected"])] for r in ho["runs"]])
        lines += [f"Geometric mean: {ho['geomean_vs_earlier']:.3f}x against the earlier "
                  f"defaults, {ho['geomean_vs_paper']:.3f}x against mooncake-paper.", ""]
    s = doc.get("speed")
    if s:
        lines += ["## Simulator speed", "",
                  f"Whole conversation trace (12,031 requests), 16P+16D, fresh process, "
                  f"start-up included, fastest of {len(s.get('runs', {}).get('conductor', [0]))}"
                  f": conductor {s['conductor']:.2f} s, random {s['random']:.2f} s (every "
                  "run: " + "; ".join(f"{p} " + ", ".join(f"{t:.2f}" for t in ts)
                                     for p, ts in s.get("runs", {}).items())
                  + f"; load average {s['load_average']:.1f}).", ""]
    lines += ["## Targets", ""] + [f"- {x}" for x in doc["verdicts"]] + [""]
    return "\n".join(lines)


def verdicts(doc: dict[str, Any]) -> list[str]:
    out = []
    t = doc.get("tables")
    if t:
        for mode in ("full", "routing-only"):
            runs = [r for r in t["runs"] if r["mode"] == mode and "ttft_ratio" in r]
            if not runs:
                continue
            worst = min(runs, key=lambda r: r["ttft_ratio"])
            met = sum(r["ttft_ratio"] >= TTFT_MARGIN for r in runs)
            slo = sum(r["slo_margin"] >= 0 for r in runs)
            out.append(f"{mode}: TTFT ratio ≥ {TTFT_MARGIN:.2f}x in {met}/{len(runs)} runs "
                       f"(lowest {worst['ttft_ratio']:.3f}x, {worst['workload']} at "
                       f"{100 * worst['load']:.0f}% vs {worst['best_other']}); conductor SLO ≥ "
                       f"every other in {slo}/{len(runs)}")
            if mode == "full":
                short = [r for r in runs if r["ttft_ratio"] < TTFT_MARGIN]
                if short:
                    out.append("where the short runs' served TTFT goes (prefill + wait, "
                               "conductor against the best other): " + "; ".join(
                                   f"{r['workload']} at {100 * r['load']:.0f}%: "
                                   + _split(r["results"]["conductor"]) + " against "
                                   + _split(r["results"][r["best_other"]]) for r in short))
                hits = [r["hit_of_ceiling"] for r in runs]
                out.append(f"hit ratio ≥ {100 * HIT_OF_CEILING:.0f}% of the served requests' "
                           f"ceiling in {sum(h >= HIT_OF_CEILING for h in hits)}/{len(hits)} "
                           f"full-system runs (lowest {100 * min(hits):.1f}%)")
                out.append(f"full-system ratios include conductor's extras ({CONDUCTOR_EXTRAS}), "
                           "which the others do not have; the routing-only and offered "
                           "ratios and the capacity do not")
        bounded = [r for r in t["runs"] if "conductor_excess_s" in r
                   and r["load"] == BOUND_LOAD]
        if bounded:
            near = [r for r in bounded
                    if r["results"]["conductor"]["ttft_over_bound"] <= BOUND_GOAL]
            far = [r for r in bounded if r not in near]
            out.append(f"TTFT lower bound: conductor within {BOUND_GOAL:.2f}x of it at "
                       f"{100 * BOUND_LOAD:.0f}% load in {len(near)}/{len(bounded)} runs"
                       + ("; where not, the most is lost to: " + "; ".join(
                           f"{r['workload']} {r['mode']} "
                           f"{r['results']['conductor']['ttft_over_bound']:.2f}x, "
                           f"{_lost(r)} ({_excess(r)}{_alone(t, r)})" for r in far)
                          if far else ""))
            full_far = [r for r in far if r["mode"] == "full" and "hit_of_ceiling" in r]
            if full_far:
                low = min(r["hit_of_ceiling"] for r in full_far)
                out.append("the full-system bound gives every prompt a pipeline over idle "
                           "instances at once, which a loaded pool does not have; with the "
                           f"hit ratio at least {100 * low:.1f}% of its ceiling there, the "
                           "prefill beyond the ideal is mostly pipelines smaller or rarer "
                           "than the bound's and loading the reused prefix, not cache misses")
    of = doc.get("offered")
    if of:
        own = {(r["workload"], r["load"]): r for r in (t or {}).get("runs", [])
               if r["mode"] == "full" and "ttft_ratio" in r}
        runs = [r for r in of["runs"] if "ttft_ratio" in r]
        if runs:
            fair = {id(r): _fair_ratio(r, own) for r in runs}
            worst = min(runs, key=lambda r: fair[id(r)])
            out.append(f"full system, every other design with or without shedding, stealing "
                       f"and holding (the better for it): TTFT ratio ≥ {TTFT_MARGIN:.2f}x in "
                       f"{sum(x >= TTFT_MARGIN for x in fair.values())}/{len(runs)} runs "
                       f"(lowest {fair[id(worst)]:.3f}x, {worst['workload']} at "
                       f"{100 * worst['load']:.0f}%); with the three forced on, conductor SLO "
                       f"≥ every other in {sum(r['slo_margin'] >= 0 for r in runs)}/{len(runs)}")
    sd = doc.get("seeds")
    if sd:
        cells = [x for r in sd["runs"] for x in r["seeds"].values() if "ttft_ratio" in x]
        met = sum(x["ttft_ratio"] >= TTFT_MARGIN for x in cells)
        slo = sum(x["slo_margin"] >= 0 for x in cells)
        lowest = min(sd["runs"], key=lambda r: r["ttft_ratio_mean"])
        out.append(f"across seeds {', '.join(map(str, sd['seeds']))}: full-system TTFT ratio "
                   f"≥ {TTFT_MARGIN:.2f}x in {met}/{len(cells)} runs, SLO ≥ every other in "
                   f"{slo}/{len(cells)}; lowest mean ratio {lowest['ttft_ratio_mean']:.3f}x "
                   f"({lowest['workload']} at {100 * lowest['load']:.0f}%)")
    ex = doc.get("exact")
    if ex:
        runs = ex["runs"]
        kept = [r for r in runs if r["ttft_ratio"] >= TTFT_MARGIN]
        out.append(f"with exact predictions: TTFT ratio ≥ {TTFT_MARGIN:.2f}x in "
                   f"{len(kept)}/{len(runs)} full-system settings ("
                   + "; ".join(f"{r['workload']} at {100 * r['load']:.0f}%: "
                               f"{_ratio(r['noisy_ttft_ratio'])} → {_ratio(r['ttft_ratio'])}"
                               for r in runs) + ")")
    pl = doc.get("pools")
    if pl:
        runs = pl["runs"]
        lost = [r for r in runs if r["ttft_ratio"] < 1.0]
        out.append(f"other pool sizes ({', '.join(map(str, pl['sizes']))} prefill instances): "
                   f"conductor's charged TTFT lowest in {len(runs) - len(lost)}/{len(runs)} "
                   f"runs, ≥ {TTFT_MARGIN:.2f}x in "
                   f"{sum(r['ttft_ratio'] >= TTFT_MARGIN for r in runs)}/{len(runs)}, SLO ≥ "
                   f"every other in {sum(r['slo_margin'] >= 0 for r in runs)}/{len(runs)}"
                   + ("; behind in: " + "; ".join(
                       f"{r['prefill']}P {r['workload']} at {100 * r['load']:.0f}% "
                       f"({r['ttft_ratio']:.3f}x vs {r['best_other']})" for r in lost)
                      if lost else ""))
    ho = doc.get("heldout")
    if ho:
        runs = ho["runs"]
        low = min(runs, key=lambda r: r["vs_paper"])
        out.append(f"held-out workloads ({len(runs)} runs): {ho['geomean_vs_earlier']:.3f}x "
                   "the earlier CPP defaults (geometric mean, "
                   f"{sum(r['vs_earlier'] >= 1.0 for r in runs)}/{len(runs)} at least level); "
                   f"against mooncake-paper's better reading ≥ {TTFT_MARGIN:.2f}x in "
                   f"{sum(r['vs_paper'] >= TTFT_MARGIN for r in runs)}/{len(runs)}, lowest "
                   f"{low['vs_paper']:.3f}x ({low['prefill']}P {low['workload']} at "
                   f"{100 * low['load']:.0f}%)")
    c = doc.get("capacity")
    if c and "ratio_to_best" in c and "of_bound" in c:
        ok = c["ratio_to_best"] >= CAPACITY_MARGIN
        out.append(f"capacity, every design offered shedding, stealing and holding: "
                   f"{c['ratio_to_best']:.3f}x the best other ({c['best_other']}), "
                   f"{_pct(c['of_bound'])} of the bound at the target: "
                   f"{'met' if ok else 'not met'} (target {CAPACITY_MARGIN:.2f}x)")
    cal = doc.get("calibration")
    if cal:
        r = cal["runs"]["calibrated"]
        first = r["first_window_under_10pct"]
        ok = first is not None and first <= 1 and r["ttft_vs_told"] <= CALIBRATED_TTFT
        out.append(f"calibration: error under 10% from window {first} (of 200 prefills), "
                   f"TTFT {r['ttft_vs_told']:.3f}x the run told the truth: "
                   f"{'met' if ok else 'not met'} (target ≤ {CALIBRATED_TTFT:.2f}x)")
    s = doc.get("speed")
    if s:
        met = "met" if s["conductor"] < SPEED_TARGET_S else "not met"
        out.append(f"simulator speed: {s['conductor']:.2f} s for the whole trace (target < "
                   f"{SPEED_TARGET_S:.0f} s): {met}")
    return out


def _seed_cell(r: dict[str, Any]) -> str:
    """One seed's ratio and the policy it is against."""
    return f"{r['ttft_ratio']:.3f}x vs {r['best_other']}" if "ttft_ratio" in r else "–"


def _slo_cell(run: dict[str, Any]) -> str:
    """The seed where conductor's SLO attainment is least above (or most below) the best
    other's, in points."""
    rows = [x for x in run["seeds"].values() if "slo_margin" in x]
    if not rows:
        return "–"
    low = min(rows, key=lambda x: x["slo_margin"])
    return f"{100 * low['slo_margin']:+.2f} points vs {low['best_slo_other']}"


def _fair_ratio(run: dict[str, Any], own: dict[tuple[str, float], dict[str, Any]]) -> float:
    """An offered run's ratio, or the tables' own-capability one where that is lower:
    each other design as it does better, with conductor's extras or without."""
    mine = own.get((run["workload"], run["load"]))
    return min(run["ttft_ratio"], mine["ttft_ratio"]) if mine else float(run["ttft_ratio"])


def _one_instance_bound(tables: dict[str, Any], run: dict[str, Any]) -> float | None:
    """For a full-system run, the bound of the routing-only run of the same workload and
    load (no CPP: one instance per prompt); None for a routing-only run or without one."""
    if run["mode"] != "full":
        return None
    for r in tables["runs"]:
        if (r["mode"] == "routing-only" and r["workload"] == run["workload"]
                and r["load"] == run["load"] and "ttft_lower_bound_s" in r):
            return float(r["ttft_lower_bound_s"])
    return None


def _excess(run: dict[str, Any]) -> str:
    """Conductor's charged TTFT above the bound, per request, by where it went."""
    e = run["conductor_excess_s"]
    return (f"{sum(e.values()):.3f} s: wait {e['wait']:.3f} s, prefill beyond the ideal "
            f"{e['prefill']:.3f} s, rejections {e['rejected']:.3f} s")


def _alone(tables: dict[str, Any], run: dict[str, Any]) -> str:
    """``; x.xxx of the one-instance bound`` for a full-system run that has one."""
    alone = _one_instance_bound(tables, run)
    if alone is None:
        return ""
    return (f"; {run['results']['conductor']['ttft_mean_charged_s'] / alone:.2f}x the bound "
            "with one instance per prompt")


def _lost(run: dict[str, Any]) -> str:
    """The largest part of conductor's excess over the bound, in words."""
    names = {"wait": "queueing (wait: queue, fetches, holds)",
             "prefill": "prefill beyond the ideal (cache misses, CPP)",
             "rejected": "rejections"}
    e = run["conductor_excess_s"]
    return names[max(e, key=lambda k: e[k])]


def _split(r: dict[str, Any]) -> str:
    """A result's served TTFT as ``prefill + wait``."""
    return f"{r['prefill_exec_mean_s']:.2f} + {r['ttft_wait_mean_s']:.2f} s"


def _merge(doc: dict[str, Any], earlier: dict[str, Any], ran: list[str]) -> None:
    """``earlier``'s sections that did not run now go into ``doc``; ``sections_run`` says
    when each section ran."""
    when = dict(earlier.get("sections_run")
                or {n: earlier["started"] for n in SECTIONS if n in earlier})
    for name in SECTIONS:
        if name not in ran and name in earlier:
            doc[name] = earlier[name]
    when.update({n: doc["started"] for n in ran})
    doc["sections_run"] = {n: when[n] for n in SECTIONS if n in doc}


def _seeds(text: str) -> list[int]:
    """``--seeds``: comma-separated whole numbers other than 0 (the tables' own)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not out or 0 in out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"distinct seeds other than 0, please: {text!r}")
    return out


def _loads(text: str) -> list[float]:
    """``--loads``: comma-separated positive shares of capacity."""
    try:
        loads = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not all(math.isfinite(x) and x > 0 for x in loads):
        raise argparse.ArgumentTypeError(f"loads must be positive: {text!r}")
    return loads


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=_positive, default=3000,
                    help="requests per synthetic workload")
    ap.add_argument("--loads", type=_loads, default=[0.8, 1.1],
                    help="cold-prefill loads to replay at, comma-separated (default 0.8,1.1)")
    ap.add_argument("--seeds", type=_seeds, default=[1, 2],
                    help="seeds the seeds section runs the full-system tables with, beside "
                    "the tables' own seed 0 (default 1,2)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--capacity-policies", default=DEFAULT_CAPACITY)
    ap.add_argument("--skip", default="", help=f"sections to skip, of {','.join(SECTIONS)}")
    ap.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write every number as JSON")
    ap.add_argument("--markdown", default=None, help="write the tables as Markdown")
    ap.add_argument("--merge", default=None, metavar="EARLIER.json",
                    help="keep the sections skipped here from this earlier run's JSON (the "
                    "report says which run each section comes from)")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(SECTIONS):
        ap.error(f"unknown section(s) {', '.join(sorted(skip - set(SECTIONS)))}")
    policies = args.policies.split(",")
    known = policy_names()
    for flag, names in (("--policies", policies),
                        ("--capacity-policies", args.capacity_policies.split(","))):
        unknown = [p for p in names if p not in known]
        if unknown:
            ap.error(f"{flag}: unknown policy {', '.join(unknown)}; known: {', '.join(known)}")
    doc: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "settings": {"policies": policies, "loads": args.loads,
                                        "requests_per_synthetic": args.requests,
                                        "cpus": os.cpu_count()}}
    t0 = time.perf_counter()
    for name, fn in (("tables", lambda: tables(args, policies)),
                     ("offered", lambda: offered(args, policies)),
                     ("seeds", lambda: seeds(args, policies, doc.get("tables"))),
                     ("exact", lambda: exact(args, doc.get("tables"))),
                     ("pools", lambda: pools(args)), ("heldout", lambda: heldout(args)),
                     ("capacity",
                     lambda: capacity(args)), ("calibration", lambda: calibration(args)),
                     ("hot", lambda: hot(args)), ("long", lambda: long_prompts(args)),
                     ("decode", lambda: decode_bound(args)),
                     ("ablation", lambda: ablation(args)), ("speed", lambda: speed(args))):
        if name not in skip:
            doc[name] = fn()
    if args.merge:
        _merge(doc, json.loads(Path(args.merge).read_text()),
               [n for n in SECTIONS if n not in skip])
    doc["settings"]["load_end"] = os.getloadavg()[0]
    doc["settings"]["wall_seconds"] = time.perf_counter() - t0
    doc["verdicts"] = verdicts(doc)
    text = markdown(doc)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
