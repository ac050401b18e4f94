"""Does the simulator describe the live system? (issue 33): one trace slice through the
simulator and through the live gateway, policy by policy, side by side.

    python benchmarks/sim_live_agreement.py [--requests 200] [--instances 4]
        [--speed 0.5] [--time-scale 0.5] [--max-output 64]
        [--policies random,round-robin,conductor] [--repeats 1]
        [--json OUT] [--markdown OUT]

The slice: the first ``--requests`` requests of the bundled conversation trace, each
``max_tokens`` capped at ``--max-output`` (as the replay client caps it), arrivals spread
within the trace's 3 s rounding step (seed 0) so that live and simulated requests come
in one order and a policy's random draws fall on the same requests in both.

**Live**: a real ``mooncake_master``, ``--instances`` prefill and as many decode
simulated workers at ``--time-scale`` (stepping prompts in arrival order through vLLM's
default budget of 8192 tokens, one forward pass per step), the
gateway with that policy, and the slice replayed at ``--speed`` (modelled) by
``mooncake-operator replay``'s client. Every engine's prefix cache is emptied before each
run; there is no warm-up pass, so both sides start cold.

**Simulated**: the same cluster in :mod:`mooncake_sim.engine`, with the Conductor
settings the gateway runs (its model settings, parsed by the gateway's own
``ModelSettings``: for ``conductor`` that turns chunked pipeline prefill and priority
queues off, which the simulated workers cannot run; and work stealing off, as the gateway
runs it without late binding, :func:`mooncake_gateway.liveconfig.conductor_config`),
the workers' KV capacity as each prefill instance's cache, the workers' step budget as its
prefill engines' (``engine_chunk_tokens``: a prompt longer than 8192 tokens runs as
several passes, each with its fixed cost, on both sides; the Conductor predicts one pass
on both sides), and no other realism knob (the workers run the cost model exactly).

Per policy: mean TTFT of the served requests, live as the client saw it and simulated;
the part after the prefill answered (the *decode leg*: the KV hand-off, the decode
engine's first step and, live, the HTTP hops back) on both sides; the live mean without
it against the simulator's TTFT at the end of the prefill; the share of requests whose
prefill instance is the same on both sides; and the online calibration the live gateway
learnt. The simulator's decode instances pull the KV once the prefill ends
(``kv_handoff="after-prefill"``), as the simulated workers do, and its client TTFT is
the decode instance's first token (``client_ttft_mean_s``), as the gateway streams it.
The bar (issue 33): every policy within 10% and the same ranking.

The simulator runs twice per policy: the cost model alone, and *with the testbed's time*:
each prefill ``prefill_overhead_s`` longer, unpredicted, that being the testbed's own
time per prefill beyond the model's (in the workers' steps) measured before the policies
run (:func:`overhead_probe`: prompts of
the slice's sizes, one at a time, on idle engines), never from the policies' TTFTs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mooncake_conductor.cost import CostModel
from mooncake_conductor.engine import ConductorConfig
from mooncake_conductor.stepcost import chunked_prefill_time
from mooncake_gateway.liveconfig import conductor_config
from mooncake_gateway.replay import ReplayConfig, replay
from mooncake_gateway.settings import GatewaySettings, ModelSettings
from mooncake_sim.engine import SimConfig, Simulation
from mooncake_sim.trace import (
    TraceRecord,
    arrival_tick_ms,
    bundled_trace,
    load_trace,
    spread_arrivals,
)
from mooncake_testbed.overload import sole_answer
from mooncake_testbed.procs import (
    MODEL,
    Unavailable,
    model_config,
    run_gateway,
    run_master,
    run_worker,
)
from mooncake_testbed.report import envelope, provenance, publish
from mooncake_worker.settings import WorkerSettings

#: the issue's bar on every policy's mean TTFT, simulated against live
TARGET = 0.10
#: decision records kept by the gateway: every request of the slice, with room
DECISIONS_KEPT = 10_000
#: the overhead probe: prompts sent one at a time to idle engines, each this many
#: modelled seconds after the previous one beyond twice its model time
PROBE_PROMPTS = 12
PROBE_SLACK_S = 0.5
#: the workers' step budget (they run with its default): the simulator's prefill engines
#: run each prompt in passes of at most this many tokens, as the workers do
ENGINE_CHUNK_TOKENS = WorkerSettings().chunked_prefill_tokens
#: added to the probe's block hashes, so that its prompts share nothing with the slice's
PROBE_HASH_OFFSET = 1 << 40


def trace_slice(n: int, max_output: int, spread: bool) -> list[TraceRecord]:
    recs = load_trace(bundled_trace())[:n]
    recs = [dataclasses.replace(r, output_length=max(1, min(r.output_length, max_output)))
            for r in recs]
    tick = arrival_tick_ms(recs)
    return spread_arrivals(recs, tick) if spread and tick > 0 else recs


def live_run(policy: str, recs: list[TraceRecord], a: argparse.Namespace,
             prefill: list[Any], decode: list[Any]) -> dict[str, Any]:
    """One replay through a fresh gateway with ``policy``: its summary, each request's
    TTFT and prefill instance, the calibration it learnt, and what its decision records
    tell (the decode leg, the overhead on idle engines)."""
    for w in prefill + decode:
        w.post("/reset_prefix_cache", {})
    cfg = model_config(prefill, decode, max_model_len=a.max_model_len,
                       conductor={"policy": policy})
    gateway = {"time_scale": a.time_scale, "decisions_kept": DECISIONS_KEPT}
    # what the gateway runs (work stealing only where it can hold prefills)
    conductor = conductor_config(ModelSettings.model_validate(cfg),
                                 GatewaySettings.model_validate(gateway))
    with run_gateway([cfg], **gateway) as g:
        state = g.state()
        if state["capabilities"] != conductor.capabilities().on():
            raise RuntimeError(f"the gateway runs {state['capabilities']}, not the "
                               f"simulator's {conductor.capabilities().on()}")
        res = asyncio.run(replay(recs, ReplayConfig(
            url=g.url, speed=a.speed / a.time_scale, time_scale=a.time_scale,
            max_output_tokens=a.max_output, keep_outcomes=True)))
        decisions = g.get(f"/conductor/decisions?model={MODEL}&limit={DECISIONS_KEPT}")
        calibration = g.state()["calibration"]
    decisions.sort(key=lambda r: r["id"])  # the gateway's arrival order
    names = [w.url for w in prefill]
    choices = [names.index(r["prefill"]) if r.get("prefill") in names else None
               for r in decisions]
    legs = []  # client TTFT after the prefill answered, served requests
    for out, rec in zip(res["outcomes"], decisions, strict=False):
        answered = answered_s(rec)
        if out["status"] == "ok" and answered:
            legs.append(out["ttft_s"] - sum(answered))
    return {"summary": {k: v for k, v in res.items() if k != "outcomes"},
            "ttft_s": [o["ttft_s"] if o["status"] == "ok" else None for o in res["outcomes"]],
            "prefill_choice": choices, "calibration": calibration, "conductor": conductor,
            "decode_leg_mean_s": statistics.fmean(legs) if legs else math.nan,
            "decisions": decisions}


def answered_s(record: dict[str, Any]) -> list[float]:
    """The modelled seconds of each prefill attempt of a decision record that answered."""
    return [x["answered_s"] for x in record["attempts"] if x.get("status") == 200]


def engine_overhead(decisions: list[dict[str, Any]]) -> list[float]:
    """Per prefill answered at the first attempt: the modelled seconds from placement to
    answer beyond the cost model's time for it (in the workers' steps)."""
    cost = CostModel()  # the workers run the default model
    extra = []
    for r in decisions:
        only = sole_answer(r)
        if only is None:
            continue
        n = r["prompt_tokens"]
        cached = min(int(r.get("engine_cached_tokens") or 0), n - 1)
        extra.append(only["answered_s"]
                     - chunked_prefill_time(cost, n, cached, ENGINE_CHUNK_TOKENS, cached))
    return extra


def overhead_probe(recs: list[TraceRecord], a: argparse.Namespace, prefill: list[Any],
                   decode: list[Any]) -> list[float]:
    """The testbed's own time per prefill, measured before the policies run: prompts of
    the slice's sizes (fresh blocks) sent one at a time through a gateway to idle
    engines, each answered prefill's time beyond the cost model's (HTTP hops and the
    Python work of the gateway and the worker, which the model does not count)."""
    cost = CostModel()
    by_size = sorted(recs, key=lambda r: r.input_length)
    picks = by_size[:: max(1, len(by_size) // PROBE_PROMPTS)][:PROBE_PROMPTS]
    probe, at_s = [], 0.0
    for r in picks:  # each alone: the next comes after twice its model time
        probe.append(dataclasses.replace(
            r, timestamp_ms=1000.0 * a.speed * at_s,
            hash_ids=tuple(h + PROBE_HASH_OFFSET for h in r.hash_ids)))
        at_s += 2 * cost.prefill_time(r.input_length) + PROBE_SLACK_S
    return engine_overhead(live_run("round-robin", probe, a, prefill, decode)["decisions"])


def sim_run(conductor: ConductorConfig, recs: list[TraceRecord],
            a: argparse.Namespace, overhead_s: float = 0.0) -> dict[str, Any]:
    sim = Simulation(recs, SimConfig(
        prefill=a.instances, decode=a.instances, speed=a.speed,
        prefill_cache_tokens=CostModel().kv_capacity_tokens, conductor=conductor,
        kv_handoff="after-prefill",  # the workers pull the KV once the prefill answered
        prefill_overhead_s=overhead_s, engine_chunk_tokens=ENGINE_CHUNK_TOKENS))
    res = sim.run()
    choices = [r.decision.placement.prefill if r.decision is not None else None
               for r in sim.reqs]
    return {"ttft_mean_s": res["ttft_mean_s"], "client_ttft_mean_s": res["client_ttft_mean_s"],
            "rejected": res["rejected"], "prefill_choice": choices}


def same_prefill(sim: dict[str, Any], live: dict[str, Any]) -> float:
    same = sum(1 for s, x in zip(sim["prefill_choice"], live["prefill_choice"], strict=False)
               if s is not None and s == x)
    return same / max(1, len(live["prefill_choice"]))


def ranking(means: dict[str, float]) -> list[str]:
    return sorted(means, key=lambda p: means[p])


def measure(a: argparse.Namespace, recs: list[TraceRecord]) -> dict[str, Any]:
    policies = a.policies.split(",")
    lives: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    overheads: list[float] = []
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(run_master())
        common = ("--time-scale", str(a.time_scale), "--max-model-len", str(a.max_model_len),
                  "--store", m.rpc, "--store-metadata", m.metadata)
        prefill = [stack.enter_context(run_worker(*common, "--role", "prefill",
                                                  "--max-running", "1"))
                   for _ in range(a.instances)]
        decode = [stack.enter_context(run_worker(*common, "--role", "decode"))
                  for _ in range(a.instances)]
        overheads = overhead_probe(recs, a, prefill, decode)
        print(f"overhead probe: {len(overheads)} prefills, "
              f"{1000 * statistics.fmean(overheads):.0f} ms beyond the model on average",
              file=sys.stderr, flush=True)
        for rep in range(a.repeats):
            for policy in policies:  # in turns: a slow spell of the host hits every policy
                t = time.time()
                run = live_run(policy, recs, a, prefill, decode)
                lives[policy].append(run)
                s = run["summary"]
                print(f"live {policy} (run {rep + 1}/{a.repeats}): mean TTFT "
                      f"{s['ttft_mean_s']:.3f} s, {s['completed']} served, "
                      f"{s['rejected']} rejected, {s['failed']} failed "
                      f"({time.time() - t:.0f} s)", file=sys.stderr, flush=True)
    # the testbed's time per prefill beyond the model (a property of the testbed, not of
    # a policy: measured on idle engines)
    overhead = max(0.0, statistics.fmean(overheads)) if overheads else 0.0
    rows = {}
    for policy in policies:
        runs = lives[policy]
        sim = sim_run(runs[0]["conductor"], recs, a)
        testbed = sim_run(runs[0]["conductor"], recs, a, overhead)
        live_mean = statistics.fmean(r["summary"]["ttft_mean_s"] for r in runs)
        leg = statistics.fmean(r["decode_leg_mean_s"] for r in runs)
        rows[policy] = {
            "live_ttft_mean_s": live_mean,
            "live_runs_ttft_mean_s": [r["summary"]["ttft_mean_s"] for r in runs],
            "live_decode_leg_mean_s": leg,
            "live_to_prefill_answer_mean_s": live_mean - leg,
            "live_rejected": [r["summary"]["rejected"] for r in runs],
            "live_failed": [r["summary"]["failed"] for r in runs],
            "live_calibration": [r["calibration"] for r in runs],
            "sim_ttft_mean_s": sim["client_ttft_mean_s"],
            "sim_to_prefill_end_mean_s": sim["ttft_mean_s"],
            "sim_decode_leg_mean_s": sim["client_ttft_mean_s"] - sim["ttft_mean_s"],
            "sim_rejected": sim["rejected"],
            "ratio": live_mean / sim["client_ttft_mean_s"],
            "sim_testbed_ttft_mean_s": testbed["client_ttft_mean_s"],
            "ratio_testbed": live_mean / testbed["client_ttft_mean_s"],
            "ratio_to_prefill_answer": (live_mean - leg) / sim["ttft_mean_s"],
            "same_prefill": same_prefill(sim, runs[0]),
            "conductor": runs[0]["conductor"].model_dump(mode="json"),
            # per request: each run's TTFTs
            "live_runs": [{k: v for k, v in r.items()
                           if k not in ("prefill_choice", "conductor", "decisions")}
                          for r in runs],
        }
    return {"rows": rows, "testbed_overhead_s": overhead, "overhead_prefills": len(overheads)}


def verdict(rows: dict[str, Any], key: str,
            sim_key: str = "sim_ttft_mean_s") -> tuple[bool, bool, str]:
    """Every policy within the bar by ``key``'s ratio, the same ranking (the simulator's
    by ``sim_key``), and the furthest policy."""
    within = all(abs(r[key] - 1.0) <= TARGET for r in rows.values())
    live = ranking({p: r["live_ttft_mean_s"] for p, r in rows.items()})
    sim = ranking({p: r[sim_key] for p, r in rows.items()})
    worst = max(rows, key=lambda p: abs(rows[p][key] - 1.0))
    return within, live == sim, worst


def markdown(doc: dict[str, Any], json_name: str | None = None) -> str:
    """The page; ``json_name``: the raw runs' file beside it, linked when given."""
    s, rows = doc["settings"], doc["result"]["rows"]
    lines = [
        "# Simulator and live system, side by side",
        "",
        provenance(doc) + " Source: `benchmarks/sim_live_agreement.py` "
        "(its docstring has the method)"
        + (f"; raw runs: [{json_name}]({json_name})." if json_name else "."),
        "",
        f"The first {s['requests']} requests of the conversation trace (output capped at "
        f"{s['max_output']} tokens, arrivals spread within the trace's 3 s step), "
        f"{s['instances']}P + {s['instances']}D, speed {s['speed']:g}, simulated workers "
        f"at time scale {s['time_scale']:g} with a real Mooncake master, "
        f"{s['repeats']} live run(s) per policy; the simulator runs the Conductor settings "
        "the gateway runs"
        + (f", and its prefill engines run a prompt longer than {s['engine_chunk_tokens']} "
           "tokens in passes of that many, as the workers step it"
           if s.get("engine_chunk_tokens") else "")
        + ". Mean TTFT of the served requests, modelled seconds, to the "
        "first token of the decode engine on both sides (the simulator's decode instances "
        "pull the KV once the prefill ends, as the workers do). The *decode leg* is the "
        "part after the prefill answered: the KV hand-off and the decode engine's first "
        "step, and live the HTTP hops back and the store's own calls. *With the "
        "testbed's time*: the simulator again, each prefill "
        f"{1000 * doc['result']['testbed_overhead_s']:.0f} ms longer than the model, "
        "unpredicted: the mean time beyond the cost model's, placement to answer, of "
        f"{doc['result']['overhead_prefills']} prompts of the slice's sizes sent one at a "
        "time through a gateway to the idle engines before the policies ran (HTTP hops "
        "and the Python work of the gateway and the worker).",
        "",
        "| policy | live TTFT | simulated TTFT | live / simulated | with the testbed's time "
        "| live / simulated | decode leg live / sim | to the prefill's end: live / sim | "
        "same prefill instance | rejected live / sim | prefill scale learnt live |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, r in rows.items():
        runs = ", ".join(f"{x:.2f}" for x in r["live_runs_ttft_mean_s"])
        scales = ", ".join(f"{c['prefill_scale']:.3f}" for c in r["live_calibration"])
        rejected = ", ".join(str(x) for x in r["live_rejected"])
        lines.append(
            f"| {p} | {r['live_ttft_mean_s']:.3f} ({runs}) | {r['sim_ttft_mean_s']:.3f} | "
            f"**{r['ratio']:.3f}** | {r['sim_testbed_ttft_mean_s']:.3f} | "
            f"**{r['ratio_testbed']:.3f}** | {r['live_decode_leg_mean_s']:.3f} / "
            f"{r['sim_decode_leg_mean_s']:.3f} | "
            f"{r['ratio_to_prefill_answer']:.3f} | {100 * r['same_prefill']:.0f}% | "
            f"{rejected} / {r['sim_rejected']} | {scales} |")
    lines.append("")
    for key, sim_key, label in (
            ("ratio", "sim_ttft_mean_s", "TTFT as the client saw it"),
            ("ratio_testbed", "sim_testbed_ttft_mean_s",
             "TTFT as the client saw it, the simulator given the testbed's time"),
            ("ratio_to_prefill_answer", "sim_ttft_mean_s", "TTFT to the prefill's end")):
        within, same, worst = verdict(rows, key, sim_key)
        lines.append(
            f"- {label}: every policy within {100 * TARGET:.0f}%: "
            f"{'met' if within else 'not met'} (furthest: {worst}, "
            f"{100 * (rows[worst][key] - 1.0):+.1f}%); same ranking: "
            f"{'yes' if same else 'no'}")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--speed", type=float, default=0.5)
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--policies", default="random,round-robin,conductor")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-spread", dest="spread", action="store_false",
                    help="keep the trace's rounded arrivals (requests at one instant)")
    ap.add_argument("--json", dest="json_out", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    if min(a.requests, a.instances, a.repeats, a.max_output) < 1:
        ap.error("--requests, --instances, --repeats and --max-output must be at least 1")
    if a.speed <= 0 or a.time_scale <= 0:
        ap.error("--speed and --time-scale must be positive")
    recs = trace_slice(a.requests, a.max_output, a.spread)
    started = time.time()
    result = measure(a, recs)
    doc = envelope("sim_live_agreement.py", started,
                   {k: getattr(a, k) for k in ("requests", "instances", "speed", "time_scale",
                                               "max_output", "repeats", "spread", "policies")}
                   | {"engine_chunk_tokens": ENGINE_CHUNK_TOKENS},
                   result=result)
    publish(doc, markdown(doc, a.json_out.name if a.json_out else None), a.json_out,
            a.markdown)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Unavailable as err:  # a missing program: what to install
        sys.exit(f"sim_live_agreement: {err}")
