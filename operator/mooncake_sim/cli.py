"""``simulate`` and ``trace-stats`` subcommands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a one-policy replay starts no pool
    import multiprocessing.context
    from concurrent.futures import ProcessPoolExecutor

#: ``--capabilities``: every design offered what it can use, or each its own defaults
CAPABILITIES = ("equal", "own")

DEFAULT_COMPARE = (
    "random,round-robin,least-load,local-cache-aware,score,sglang-cache-aware,dynamo-kv,"
    "llm-d,aibrix-prefix-cache,aibrix-conductor,kvcache-centric,mooncake-paper,conductor"
)


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    """The pool, cache, SLO and trace flags ``simulate`` and ``capacity`` share."""
    p.add_argument("--trace", default=None, help="trace file (default: bundled conversation)")
    p.add_argument("--preset", default=None, help="named setting, e.g. paper-fig5")
    p.add_argument("--prefill", type=int, default=None, help="prefill instances")
    p.add_argument("--decode", type=int, default=None, help="decode instances")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="local KV cache per prefill instance, tokens")
    p.add_argument("--store-tokens", type=int, default=None, help="shared store pool, tokens")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO, seconds")
    p.add_argument("--tbt-slo", type=float, default=None, help="TBT SLO, milliseconds")
    p.add_argument("--params", default=None,
                   help="JSON policy parameters, e.g. '{\"priority_weight\": 0}'")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("realism (the same for every policy; presets turn it on)")
    r.add_argument("--prediction-error", type=float, default=None, metavar="SIGMA",
                   help="per-request lognormal factor on prefill time (default 0; 0.2 in "
                   "presets)")
    r.add_argument("--model-bias", type=float, default=None, metavar="B",
                   help="execution = prediction x (1 + B), e.g. 0.25 (default 0)")
    r.add_argument("--prefill-overhead", dest="prefill_overhead_s", type=float, default=0.0,
                   metavar="S", help="seconds every prefill runs beyond the model, "
                   "unpredicted: a serving stack's own time (default 0)")
    r.add_argument("--event-lag-ms", type=float, default=None,
                   help="delay before the index learns stored blocks (default 0; 100 in "
                   "presets)")
    r.add_argument("--nic-contention", action=argparse.BooleanOptionalAction, default=None,
                   help="transfers queue on each node's NIC (default off; on in presets)")
    r.add_argument("--kv-handoff", choices=("layerwise", "after-prefill"), default="layerwise",
                   help="how a prompt's KV reaches its decode instance: streamed layer by "
                   "layer during the prefill (the paper's, default) or pulled once the "
                   "prefill ends (vLLM's Mooncake connector); the client's first token "
                   "(client_ttft_mean_s in --json) comes after it")
    r.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="every request asks N as max_tokens, all the Conductor knows of its "
                   "output; streams stop at their trace length or N (default: each asks "
                   "its trace length, as the replay client sends it)")
    p.add_argument("--topology", default=None, metavar="LEVEL=N[,LEVEL=N]",
                   help="domains per topology level, e.g. zone=2 or rack=4,zone=2 (links: "
                   "docs/topology.md); default a flat fleet")
    p.add_argument("--topology-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="decisions use the topology (off: its costs are still charged)")
    p.add_argument("--domain-assignment", choices=("blocked", "round-robin"),
                   default="blocked", help="how each pool's instances spread over domains")
    p.add_argument("--routing-only", action="store_true",
                   help="equal capability: every policy on local caches only (no KV fetch, "
                   "no CPP, no admission, no replication)")
    p.add_argument("--capabilities", choices=CAPABILITIES, default=None,
                   help="equal: overload shedding, work stealing and holding on for every "
                   "design that can use them (shedding and holding: those with admission); "
                   "own: each design's defaults (conductor has all three, the others none). "
                   "Default: equal for capacity, own for simulate (a full-system comparison); "
                   "--shedding, --stealing and --holding override it")
    p.add_argument("--shedding", action=argparse.BooleanOptionalAction, default=None,
                   help="overload shedding for every policy with admission (default: as "
                   "--capabilities)")
    p.add_argument("--stealing", action=argparse.BooleanOptionalAction, default=None,
                   help="idle prefill instances take prompts queued on others, for every "
                   "policy (default: as --capabilities; never with --routing-only)")
    p.add_argument("--holding", action=argparse.BooleanOptionalAction, default=None,
                   help="requests refused only for decode room wait for it while they can "
                   "still meet the TTFT SLO, for every policy with admission (default: as "
                   "--capabilities)")
    p.add_argument("--jobs", type=int, default=None, help="parallel processes")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="write a PNG chart of the results")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a Mooncake-format trace through the Conductor core",
        description="Discrete-event replay of a Mooncake-format trace (default: the bundled "
        "Mooncake conversation trace) through one or more scheduling policies.",
    )
    p.add_argument("--policy", default="conductor", help="policy name (see --list-policies)")
    p.add_argument("--compare", default=None, metavar="P1,P2,...",
                   help="run several policies on identical input; 'all' for every policy")
    p.add_argument("--speed", type=float, default=None, help="replay speed (x real time)")
    _add_setting_flags(p)
    p.add_argument("--list-policies", action="store_true", help="list policies and exit")
    p.set_defaults(handler=cmd_simulate)

    c = sub.add_parser(
        "capacity",
        help="effective request capacity of policies on a trace (the paper's headline metric)",
        description="Highest replay speed at which >= 90% of ALL requests (rejections count "
        "as misses) meet both the TTFT and the TBT SLO, found by bisection over simulated "
        "replays, next to the upper bound no design can pass and the share of work "
        "rejected at capacity. Every design is offered overload shedding, work stealing "
        "and holding unless --capabilities own. With --pd-sweep N: capacity of every "
        "prefill/decode split of N instances.",
    )
    c.add_argument("--policy", default="conductor", metavar="P[,P...]",
                   help="one or more policies, comma-separated")
    _add_setting_flags(c)
    c.add_argument("--target", type=float, default=None,
                   help="share of all requests that must meet both SLOs (default 0.9)")
    c.add_argument("--tolerance", type=float, default=None,
                   help="stop when the bracket is this narrow, relative (default 0.02)")
    c.add_argument("--pd-sweep", type=int, default=None, metavar="N",
                   help="sweep prefill/decode splits of N instances in all")
    c.add_argument("--pd-step", type=int, default=1, help="prefill count step of the sweep")
    c.set_defaults(handler=cmd_capacity)

    t = sub.add_parser("trace-stats", help="summarise a Mooncake-format trace")
    t.add_argument("file", nargs="?", default=None, help="trace file (default: bundled)")
    t.add_argument("--block-tokens", type=int, default=512)
    t.add_argument("--json", dest="json_out", default=None)
    t.set_defaults(handler=cmd_trace_stats)


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _trace_path(arg: str | None) -> Path:
    from .trace import bundled_trace

    return Path(arg) if arg else bundled_trace()


def _run_one(args: tuple[list[Any], dict[str, Any], bool]) -> dict[str, Any]:
    from .engine import SimConfig, simulate

    records, cfg, progress = args
    config = SimConfig.model_validate(cfg)
    config = config.model_copy(update={"progress": progress})
    return simulate(records, config)


@dataclass
class _Setup:
    """What ``simulate`` and ``capacity`` resolved from their shared flags."""

    path: Path
    records: list[Any]
    preset: Any
    prefill: int
    decode: int
    ttft_s: float
    tbt_ms: float
    cache_tokens: int
    store_tokens: int
    params: dict[str, Any]
    prediction_error: float
    model_bias: float
    event_lag_ms: float
    nic_contention: bool
    max_tokens: int | None = None
    kv_handoff: str = "layerwise"
    prefill_overhead_s: float = 0.0
    routing_only: bool = False
    shedding: bool | None = None
    stealing: bool | None = None
    holding: bool | None = None
    capabilities: str = "own"
    topology: dict[str, Any] | None = None  # SimConfig fields and the conductor's topology

    def config(self, policy: str, speed: float, seed: int, own_params: bool,
               prefill: int | None = None, decode: int | None = None) -> dict[str, Any]:
        """One ``SimConfig`` as a dict (validated by the caller)."""
        return {
            "prefill": prefill or self.prefill,
            "decode": decode or self.decode,
            "speed": speed,
            "prefill_cache_tokens": self.cache_tokens,
            "store_tokens": self.store_tokens,
            **self.realism(),
            "conductor": {
                "policy": policy,
                "params": self.params if own_params else {},
                "slo": {"ttft_s": self.ttft_s, "tbt_s": self.tbt_ms / 1000.0},
                "seed": seed,
                "routing_only": self.routing_only,
                **({} if self.shedding is None else {"shedding": {"enabled": self.shedding}}),
                **({} if self.stealing is None else {"stealing": {"enabled": self.stealing}}),
                **({} if self.holding is None else {"holding": {"enabled": self.holding}}),
                **({} if self.topology is None else {"topology": self.topology["topology"]}),
            },
            **({} if self.topology is None else {
                "domains": self.topology["domains"],
                "domain_assignment": self.topology["domain_assignment"]}),
        }

    def realism(self) -> dict[str, Any]:
        return {"prediction_error": self.prediction_error, "model_bias": self.model_bias,
                "event_lag_ms": self.event_lag_ms, "nic_contention": self.nic_contention,
                "max_tokens": self.max_tokens, "kv_handoff": self.kv_handoff,
                "prefill_overhead_s": self.prefill_overhead_s}

    def settings(self, preset_name: str | None, seed: int) -> dict[str, Any]:
        return {
            "trace": str(self.path),
            "requests": len(self.records),
            "preset": preset_name,
            "prefill": self.prefill,
            "decode": self.decode,
            "prefill_cache_tokens": self.cache_tokens,
            "store_tokens": self.store_tokens,
            "ttft_slo_s": self.ttft_s,
            "tbt_slo_ms": self.tbt_ms,
            "block_tokens": 512,
            "cost_model": "LLaMA3-70B on 8xA800 (FAST'25 Table 1)",
            "seed": seed,
            **self.realism(),
            "routing_only": self.routing_only,
            "shedding": self.shedding,  # null: each policy's own
            "stealing": self.stealing,  # null: each policy's own
            "holding": self.holding,  # null: each policy's own
            "capabilities": self.capabilities,
            "ttft_mean_charged": "rejected requests charged the TTFT SLO",
            **({} if self.topology is None else {"topology": self.topology}),
        }


def _policies(spec: str, known: list[str]) -> list[str] | str:
    """Comma-separated policy names, or the error message."""
    policies = [p.strip() for p in spec.split(",") if p.strip()]
    if not policies:
        return "no policy given"
    unknown = [p for p in policies if p not in known]
    if unknown:
        return f"unknown policy {', '.join(unknown)}; known: {', '.join(known)}"
    if len(set(policies)) != len(policies):
        return "a policy is listed twice"
    return policies


def _setup(args: argparse.Namespace, capabilities: str = "own") -> _Setup | str:
    """Validate the shared flags and load the trace; an error message on bad input.
    ``capabilities`` is the default of ``--capabilities``."""
    from .presets import PRESETS
    from .trace import TraceError, load_trace

    params: dict[str, Any] = {}
    if args.params:
        try:
            params = json.loads(args.params)
        except json.JSONDecodeError as exc:
            return f"--params is not valid JSON: {exc.msg}"
        if not isinstance(params, dict):
            return "--params must be a JSON object"
    preset = None
    if args.preset:
        if args.preset not in PRESETS:
            return f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}"
        preset = PRESETS[args.preset]
    for flag in ("prefill", "decode", "limit", "jobs", "max_tokens"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            return f"--{flag.replace('_', '-')} must be positive"
    over = getattr(args, "prefill_overhead_s", 0.0)
    if not math.isfinite(over) or over < 0:
        return "--prefill-overhead must be a number >= 0"
    for flag in ("prediction_error", "event_lag_ms"):
        v = getattr(args, flag)
        if v is not None and (not math.isfinite(v) or v < 0):
            return f"--{flag.replace('_', '-')} must be a number >= 0"
    if args.model_bias is not None and (not math.isfinite(args.model_bias)
                                        or args.model_bias <= -1):
        return "--model-bias must be a number > -1"
    for flag in ("speed", "ttft_slo", "tbt_slo"):
        v = getattr(args, flag, None)
        if v is not None and (not math.isfinite(v) or v <= 0):
            return f"--{flag.replace('_', '-')} must be a positive number"
    topology: dict[str, Any] | None = None
    if getattr(args, "topology", None):
        from .presets import parse_topology
        try:
            levels, domains = parse_topology(args.topology)
        except ValueError as exc:
            return f"--topology: {exc}"
        topology = {"topology": {"levels": [lv.model_dump() for lv in levels],
                                 "aware": bool(args.topology_aware)},
                    "domains": domains, "domain_assignment": args.domain_assignment}
    caps = args.capabilities or capabilities
    equal = True if caps == "equal" else None  # None: each policy's own
    path = _trace_path(args.trace)
    try:
        records = load_trace(path, limit=args.limit)
    except TraceError as exc:
        return str(exc)
    return _Setup(
        path=path,
        records=records,
        preset=preset,
        prefill=args.prefill or (preset.prefill if preset else 16),
        decode=args.decode or (preset.decode if preset else 16),
        ttft_s=args.ttft_slo or (preset.ttft_slo_s if preset else 30.0),
        tbt_ms=args.tbt_slo or (preset.tbt_slo_ms if preset else 100.0),
        cache_tokens=args.cache_tokens or (preset.prefill_cache_tokens if preset else 3_000_000),
        store_tokens=args.store_tokens or 0,
        params=params,
        prediction_error=_pick(args.prediction_error, preset, "prediction_error", 0.0),
        model_bias=_pick(args.model_bias, preset, "model_bias", 0.0),
        event_lag_ms=_pick(args.event_lag_ms, preset, "event_lag_ms", 0.0),
        nic_contention=bool(_pick(args.nic_contention, preset, "nic_contention", False)),
        max_tokens=args.max_tokens,
        kv_handoff=args.kv_handoff,
        prefill_overhead_s=over,
        routing_only=bool(args.routing_only),
        shedding=equal if args.shedding is None else args.shedding,
        stealing=equal if args.stealing is None else args.stealing,
        holding=equal if args.holding is None else args.holding,
        capabilities=caps,
        topology=topology,
    )


def _pick(flag: Any, preset: Any, name: str, default: Any) -> Any:
    """A flag's value, else the preset's, else the plain default."""
    if flag is not None:
        return flag
    return getattr(preset, name) if preset is not None else default


def _realism_line(setup: _Setup) -> str:
    return (f"prediction error {setup.prediction_error:g}, bias {setup.model_bias:g}, "
            f"event lag {setup.event_lag_ms:g} ms, NIC contention "
            f"{'on' if setup.nic_contention else 'off'}"
            + ("" if setup.max_tokens is None else f", max_tokens {setup.max_tokens}")
            + (" | routing only (no fetch, CPP, admission, replication)"
               if setup.routing_only else "") + " | " + _capabilities_line(setup))


def _capabilities_line(setup: _Setup) -> str:
    """Which reading of the designs' capabilities a run uses, in words."""
    def state(name: str, on: bool | None) -> str:
        return f"{name} {'own' if on is None else 'on' if on else 'off'}"

    switches = ", ".join(state(n, v) for n, v in (("shedding", setup.shedding),
                                                   ("stealing", setup.stealing),
                                                   ("holding", setup.holding)))
    if setup.capabilities == "equal":
        head = "capabilities equal (every design offered what it can use)"
    else:
        head = "capabilities: each design's own (conductor's not offered to the others)"
    return f"{head}: {switches}"


def _validate(cfgs: list[dict[str, Any]]) -> str | None:
    """The first pydantic error among ``cfgs`` as ``bad setting loc: msg``, else None."""
    from pydantic import ValidationError

    from .engine import SimConfig

    try:
        for cfg in cfgs:
            SimConfig.model_validate(cfg)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        return f"bad setting {loc}: {err['msg']}"
    return None


def cmd_simulate(args: argparse.Namespace) -> int:
    from .gcpause import freeze_at_exit, gc_paused

    freeze_at_exit()
    with gc_paused():  # the trace, the replay and the bound: one collection after, not many
        return _simulate(args)


def _simulate(args: argparse.Namespace) -> int:
    from mooncake_conductor.policies import policy_names

    from .presets import speed_for_utilization

    known = policy_names()
    if args.list_policies:
        from mooncake_conductor.policies import policy_class

        for name in known:
            doc = (policy_class(name).__module__, policy_class(name).__doc__)
            module = sys.modules[doc[0]]
            first = (module.__doc__ or "").strip().splitlines()[0]
            print(f"{name:20} {first}")
        return 0
    if args.compare:
        order = DEFAULT_COMPARE.split(",")
        everything = order + [p for p in known if p not in order]
        chosen = _policies(",".join(everything) if args.compare == "all" else args.compare,
                           known)
    else:
        chosen = _policies(args.policy, known)
    if isinstance(chosen, str):
        return _fail(chosen.replace("listed twice", "listed twice in --compare"))
    policies = chosen
    setup = _setup(args)
    if isinstance(setup, str):
        return _fail(setup)
    records, preset = setup.records, setup.preset
    speed = args.speed
    if speed is None:
        speed = (speed_for_utilization(records, setup.prefill, preset.target_utilization)
                 if preset else 1.0)
    configs = [setup.config(pol, speed, args.seed, len(policies) == 1 or pol == "conductor")
               for pol in policies]
    err = _validate(configs)
    if err:
        return _fail(err)
    settings = setup.settings(args.preset, args.seed)
    settings["speed"] = speed
    print(
        f"trace {setup.path.name}: {len(records)} requests | {setup.prefill} prefill + "
        f"{setup.decode} decode | speed {speed:.3g}x | cache {setup.cache_tokens:,} "
        f"tokens/instance | SLO TTFT {setup.ttft_s:g} s, TBT {setup.tbt_ms:g} ms | "
        + _realism_line(setup),
        file=sys.stderr,
    )
    jobs = args.jobs or min(len(policies), os.cpu_count() or 1)
    progress = sys.stderr.isatty() or len(records) > 2000
    work = [(records, cfg, progress and jobs == 1) for cfg in configs]
    if jobs > 1 and len(work) > 1:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        print(f"running {len(work)} policies on {jobs} processes ...", file=sys.stderr)
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(_run_one, w) for w in work]
            for done, fut in enumerate(as_completed(futures), 1):
                r = fut.result()
                print(f"  [{done}/{len(work)}] {r['policy']} ({r['wall_seconds']:.1f} s)",
                      file=sys.stderr)
            results = [f.result() for f in futures]
    else:
        results = [_run_one(w) for w in work]
    _add_bound(records, configs, results, setup.ttft_s)
    print(format_table(results))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"settings": settings, "results": results}, indent=2, default=_nan)
            + "\n"
        )
    if args.plot:
        try:
            from .plot import plot_results
        except ImportError:
            return _fail("--plot needs matplotlib: pip install 'mooncake-operator[plot]'")
        plot_results(results, settings, Path(args.plot))
    return 0


def _add_bound(records: list[Any], cfgs: list[dict[str, Any]], results: list[dict[str, Any]],
               ttft_s: float) -> None:
    """Each result's ``ttft_lower_bound_s`` (one bound for every design compared,
    :mod:`.bound`) and its charged mean TTFT over it."""
    from .bound import bounds_for, ttft_lower_bound
    from .engine import SimConfig

    bound = ttft_lower_bound(bounds_for(records, [SimConfig.model_validate(c) for c in cfgs]),
                             ttft_s)
    for r in results:
        r["ttft_lower_bound_s"] = bound
        r["ttft_charged_over_bound"] = r["ttft_mean_charged_s"] / bound if bound else math.nan


#: the trace a capacity worker process replays (sent once, by the pool's initializer)
_worker_records: list[Any] = []

#: replays ``speeds`` of one configuration, one result row per speed (in order)
RunBatch = Callable[[dict[str, Any], list[float]], list[dict[str, Any]]]
#: most threads that drive capacity searches at once (each waits on its probes)
MAX_SEARCH_THREADS = 64
#: most speeds one search probes a round: 8 already takes a 2x bracket to 2% in two
#: rounds, and every process holds the trace and a replay's state
MAX_PROBES_PER_ROUND = 8


def _thread_safe_start() -> multiprocessing.context.BaseContext:
    """How a pool that threads submit to starts its processes: from a server process
    (or afresh), never forked from this one while other threads may hold its locks."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def _init_capacity_worker(records: list[Any]) -> None:
    _worker_records[:] = records


def _replay_at(cfg: dict[str, Any], speed: float) -> dict[str, Any]:
    """One probe in a worker process: the trace it was given at ``speed``."""
    from .engine import SimConfig, simulate

    return simulate(_worker_records, SimConfig.model_validate({**cfg, "speed": speed}))


def _inline_batch(records: list[Any]) -> RunBatch:
    """Probes replayed here, one after another."""
    from .engine import SimConfig, simulate

    def run(cfg: dict[str, Any], speeds: list[float]) -> list[dict[str, Any]]:
        base = SimConfig.model_validate(cfg)
        return [simulate(records, base.model_copy(update={"speed": s})) for s in speeds]

    return run


def _pooled_batch(pool: ProcessPoolExecutor) -> RunBatch:
    """Probes replayed in ``pool``'s worker processes, a round's speeds side by side."""

    def run(cfg: dict[str, Any], speeds: list[float]) -> list[dict[str, Any]]:
        futures = [pool.submit(_replay_at, cfg, s) for s in speeds]
        return [f.result() for f in futures]

    return run


def _capacity_one(job: tuple[dict[str, Any], float, float, float], width: int,
                  run_batch: RunBatch) -> dict[str, Any]:
    """One capacity search over simulated replays, ``width`` probes a round through
    ``run_batch``."""
    from .capacity import Probe, search_capacity_batched

    cfg, start, target, tol = job
    label = f"{cfg['conductor']['policy']} {cfg['prefill']}P+{cfg['decode']}D"
    rows: dict[float, dict[str, Any]] = {}

    def attainments(speeds: list[float]) -> list[float]:
        results = run_batch(cfg, speeds)
        rows.update(zip(speeds, results, strict=True))
        return [float(r["slo_attainment"]) for r in results]

    def show(p: Probe) -> None:
        print(f"  {label}: speed {p.speed:.4g}x -> {100 * p.attainment:.2f}% in SLO "
              f"({'ok' if p.ok else 'miss'})", file=sys.stderr, flush=True)

    found = search_capacity_batched(attainments, start, width, target=target, rel_tol=tol,
                                    on_probe=show)
    at = rows.get(found.capacity_speed)
    return {
        "policy": cfg["conductor"]["policy"],
        "prefill": cfg["prefill"],
        "decode": cfg["decode"],
        "capacity_speed": found.capacity_speed,
        "bracketed": found.bracketed,
        "probes_per_round": width,
        "rounds": found.rounds,
        "probes": [{"speed": p.speed, "slo_attainment": p.attainment, "ok": p.ok}
                   for p in found.probes],
        "at_capacity": None if at is None else {
            k: at[k] for k in ("completed", "rejected", "ttft_mean_s", "ttft_p90_s",
                               "ttft_p99_s", "tbt_p90_ms", "slo_attainment", "token_hit_ratio",
                               "rejected_ids")},
    }


def cmd_capacity(args: argparse.Namespace) -> int:
    from mooncake_conductor.policies import policy_names

    from .bound import execution_factors, rejected_work_share
    from .capacity import (
        DEFAULT_REL_TOL,
        DEFAULT_TARGET,
        compute_bound_speed,
        ideal_reuse_prefill_times,
        pd_splits,
    )
    from .engine import SimConfig

    chosen = _policies(args.policy, policy_names())
    if isinstance(chosen, str):
        return _fail(chosen)
    target = DEFAULT_TARGET if args.target is None else args.target
    tol = DEFAULT_REL_TOL if args.tolerance is None else args.tolerance
    if not (math.isfinite(target) and 0 < target <= 1):
        return _fail("--target must be in (0, 1]")
    if not (math.isfinite(tol) and 0 < tol < 1):
        return _fail("--tolerance must be in (0, 1)")
    if args.pd_sweep is not None and args.pd_sweep < 2:
        return _fail("--pd-sweep needs at least 2 instances")
    if args.pd_step <= 0:
        return _fail("--pd-step must be positive")
    setup = _setup(args, "equal")
    if isinstance(setup, str):
        return _fail(setup)
    if len(setup.records) < 2:
        return _fail("the trace needs at least 2 requests to have a rate")
    splits = (pd_splits(args.pd_sweep, args.pd_step) if args.pd_sweep
              else [(setup.prefill, setup.decode)])
    # the replays' execution factors (prediction error, bias): the same for every policy
    factors = execution_factors(
        SimConfig.model_validate(setup.config(chosen[0], 1.0, args.seed, False)),
        len(setup.records))
    work = ideal_reuse_prefill_times(setup.records, factors=factors)
    limits = {p: compute_bound_speed(setup.records, p) for p, _ in splits}
    served_limits = {p: compute_bound_speed(setup.records, p, share=target,
                                            drain_s=setup.ttft_s, factors=factors)
                     for p, _ in splits}
    jobs_in: list[tuple[dict[str, Any], float, float, float]] = []
    for pol in chosen:
        for p, d in splits:
            cfg = setup.config(pol, 1.0, args.seed, len(chosen) == 1 or pol == "conductor",
                               prefill=p, decode=d)
            start = limits[p] if math.isfinite(limits[p]) else 1.0
            jobs_in.append((cfg, start, target, tol))
    err = _validate([j[0] for j in jobs_in])
    if err:
        return _fail(err)
    print(f"capacity on {setup.path.name}: {len(setup.records)} requests | "
          + (f"P/D sweep of {args.pd_sweep} instances" if args.pd_sweep
             else f"{setup.prefill} prefill + {setup.decode} decode")
          + f" | SLO TTFT {setup.ttft_s:g} s, TBT {setup.tbt_ms:g} ms | target "
          f"{100 * target:g}% of all requests | {len(jobs_in)} searches | "
          + _realism_line(setup), file=sys.stderr)
    jobs = args.jobs or os.cpu_count() or 1
    results: list[dict[str, Any]] = []
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed

        # every search in a thread of its own, their probes on one pool of processes; with
        # fewer searches than processes each search probes several speeds a round
        width = max(1, min(MAX_PROBES_PER_ROUND, jobs // len(jobs_in)))
        processes = min(jobs, len(jobs_in) * width)
        with ProcessPoolExecutor(max_workers=processes, mp_context=_thread_safe_start(),
                                 initializer=_init_capacity_worker,
                                 initargs=(setup.records,)) as pool, \
                ThreadPoolExecutor(max_workers=min(len(jobs_in), MAX_SEARCH_THREADS)) as threads:
            run_batch = _pooled_batch(pool)
            futures = [threads.submit(_capacity_one, j, width, run_batch) for j in jobs_in]
            for done, fut in enumerate(as_completed(futures), 1):
                r = fut.result()
                print(f"[{done}/{len(jobs_in)}] {r['policy']} {r['prefill']}P+{r['decode']}D: "
                      f"capacity {r['capacity_speed']:.4g}x", file=sys.stderr)
            results = [f.result() for f in futures]
    else:
        run_inline = _inline_batch(setup.records)
        for done, j in enumerate(jobs_in, 1):
            r = _capacity_one(j, 1, run_inline)
            print(f"[{done}/{len(jobs_in)}] {r['policy']} {r['prefill']}P+{r['decode']}D: "
                  f"capacity {r['capacity_speed']:.4g}x", file=sys.stderr)
            results.append(r)
    for r in results:
        r["limit_speed"] = limits[r["prefill"]]
        bound = served_limits[r["prefill"]]
        r["limit_target_speed"] = bound
        r["of_bound"] = r["capacity_speed"] / bound if math.isfinite(bound) and bound else None
        at = r["at_capacity"]
        r["rejected_work_share"] = (None if at is None
                                    else rejected_work_share(work, at.pop("rejected_ids")))
    best: dict[str, dict[str, Any]] = {}
    for r in results:
        b = best.get(r["policy"])
        if b is None or r["capacity_speed"] > b["capacity_speed"]:
            best[r["policy"]] = r
    print(format_capacity(results, bool(args.pd_sweep)))
    settings = setup.settings(args.preset, args.seed)
    settings.update({"target": target, "tolerance": tol, "pd_sweep": args.pd_sweep,
                     "pd_step": args.pd_step,
                     "limit": "ideal-reuse prefill compute of all requests over the prefill "
                     "pool: where the search starts, not a bound (rejecting the costliest "
                     "requests passes it)",
                     "limit_target": "the same for the cheapest target share of requests, "
                     "with the TTFT SLO to drain after the last arrival and the replays' "
                     "execution factors: an upper bound (of_bound = capacity over it)",
                     "rejected_work_share": "ideal-reuse prefill seconds of the requests "
                     "rejected at capacity over all requests'"})
    if args.pd_sweep:
        print("best split: " + ", ".join(
            f"{pol} {b['prefill']}P+{b['decode']}D ({b['capacity_speed']:.4g}x)"
            for pol, b in best.items()))
    if args.json_out:
        doc: dict[str, Any] = {"settings": settings, "results": results}
        if args.pd_sweep:
            doc["best"] = [{"policy": pol, "prefill": b["prefill"], "decode": b["decode"],
                            "capacity_speed": b["capacity_speed"]} for pol, b in best.items()]
        Path(args.json_out).write_text(json.dumps(doc, indent=2, default=_nan) + "\n")
    if args.plot:
        try:
            from .plot import plot_capacity
        except ImportError:
            return _fail("--plot needs matplotlib: pip install 'mooncake-operator[plot]'")
        plot_capacity(results, settings, Path(args.plot))
    return 0


def format_capacity(results: list[dict[str, Any]], sweep: bool) -> str:
    """A readable table of capacity results (one row per policy, or per policy and split)."""
    cols = ["policy", *(["P", "D"] if sweep else []), "capacity", "bound", "of bound",
            "work rejected @cap", "SLO ok @cap", "TTFT p90 @cap", "note"]
    rows = []
    for r in results:
        at = r["at_capacity"] or {}
        note = "" if r["bracketed"] else ("none met the target" if not r["capacity_speed"]
                                          else "lower bound")
        rows.append([
            r["policy"], *([str(r["prefill"]), str(r["decode"])] if sweep else []),
            f"{r['capacity_speed']:.4g}x", f"{r['limit_target_speed']:.4g}x",
            "–" if r["of_bound"] is None else f"{100 * r['of_bound']:.1f}%",
            "–" if r["rejected_work_share"] is None else f"{100 * r['rejected_work_share']:.1f}%",
            f"{100 * at['slo_attainment']:.1f}%" if at else "–",
            f"{at['ttft_p90_s']:.2f} s" if at else "–", note,
        ])
    return (_columns(cols, rows) + "\nbound: the highest speed at which the pool could "
            "compute the cheapest target share of the requests with ideal reuse (the rest "
            "rejected), draining within the TTFT SLO; no design can pass it")


def _columns(cols: list[str], rows: list[list[str]]) -> str:
    """A text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                     enumerate(zip(cols, widths, strict=True)))
    out = [line, "-" * len(line)]
    for row in rows:
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in
                             enumerate(zip(row, widths, strict=True))))
    return "\n".join(out)


def _nan(x: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {x!r}")


def format_table(results: list[dict[str, Any]]) -> str:
    ref = next((r for r in results if r["policy"] == "conductor"), None)
    cols = ["policy", "done", "rej", "TTFT mean", "wait", "charged", "p50", "p90", "p99",
            "TBT p90", "SLO ok", "hit", "GPU s", "charged/cond", "charged/bound"]
    rows = []
    for r in results:
        key = "ttft_mean_charged_s"
        ratio = (f"{r[key] / ref[key]:.2f}x"
                 if ref and ref[key] else "–")  # no conductor run to compare
        rows.append([
            r["policy"], str(r["completed"]), str(r["rejected"]),
            f"{r['ttft_mean_s']:.2f} s", f"{r['ttft_wait_mean_s']:.2f} s", f"{r[key]:.2f} s",
            f"{r['ttft_p50_s']:.2f}",
            f"{r['ttft_p90_s']:.2f}",
            f"{r['ttft_p99_s']:.2f}", f"{r['tbt_p90_ms']:.1f} ms",
            f"{100 * r['slo_attainment']:.2f}%", f"{100 * r['token_hit_ratio']:.1f}%",
            f"{r['prefill_gpu_seconds']:,.0f}", ratio,
            f"{r['ttft_charged_over_bound']:.2f}x" if "ttft_charged_over_bound" in r else "–",
        ])
    bound = next((r["ttft_lower_bound_s"] for r in results if "ttft_lower_bound_s" in r), None)
    return (_columns(cols, rows) + "\nTTFT mean: served requests; wait: the part of it spent "
            "before the prefill ran (queue, fetch, hold); charged: all requests, each "
            "rejected one charged the TTFT SLO"
            + ("" if bound is None else
               f"\nbound: {bound:.3f} s, a lower bound on the charged mean TTFT (each "
               "prompt's compute under ideal reuse, with CPP over idle instances where a "
               "design may form a group, no queueing or transfer; not a target)"))


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from .trace import TraceError, load_trace, trace_stats

    if args.block_tokens <= 0:
        return _fail("--block-tokens must be positive")
    path = _trace_path(args.file)
    try:
        records = load_trace(path, block_tokens=args.block_tokens)
    except TraceError as exc:
        return _fail(str(exc))
    st = trace_stats(records, args.block_tokens)
    print(f"trace            {path}")
    print(f"requests         {st.requests:,}")
    print(f"duration         {st.duration_s:,.1f} s")
    print(f"rate             {st.rate_per_s:.2f} requests/s")
    print(f"avg input        {st.avg_input:,.0f} tokens (max {st.max_input:,})")
    print(f"avg output       {st.avg_output:,.0f} tokens")
    print(f"distinct blocks  {st.distinct_blocks:,}")
    print(f"reuse ceiling    {100 * st.reuse_ceiling_tokens:.1f}% of input tokens, "
          f"{100 * st.reuse_ceiling_blocks:.1f}% of blocks (unbounded global cache)")
    if args.json_out:
        from dataclasses import asdict

        Path(args.json_out).write_text(json.dumps(asdict(st), indent=2) + "\n")
    return 0
