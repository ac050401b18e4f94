"""``simulate`` and ``trace-stats`` subcommands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

DEFAULT_COMPARE = (
    "random,round-robin,least-load,local-cache-aware,score,sglang-cache-aware,dynamo-kv,"
    "llm-d,aibrix-conductor,kvcache-centric,conductor"
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a Mooncake-format trace through the Conductor core",
        description="Discrete-event replay of a Mooncake-format trace (default: the bundled "
        "Mooncake conversation trace) through one or more scheduling policies.",
    )
    p.add_argument("--trace", default=None, help="trace file (default: bundled conversation)")
    p.add_argument("--policy", default="conductor", help="policy name (see --list-policies)")
    p.add_argument("--compare", default=None, metavar="P1,P2,...",
                   help="run several policies on identical input; 'all' for every policy")
    p.add_argument("--preset", default=None, help="named setting, e.g. paper-fig5")
    p.add_argument("--prefill", type=int, default=None, help="prefill instances")
    p.add_argument("--decode", type=int, default=None, help="decode instances")
    p.add_argument("--speed", type=float, default=None, help="replay speed (x real time)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="local KV cache per prefill instance, tokens")
    p.add_argument("--store-tokens", type=int, default=None, help="shared store pool, tokens")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO, seconds")
    p.add_argument("--tbt-slo", type=float, default=None, help="TBT SLO, milliseconds")
    p.add_argument("--params", default=None,
                   help="JSON policy parameters, e.g. '{\"priority_weight\": 0}'")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=None, help="parallel processes for --compare")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="write a PNG chart of the results")
    p.add_argument("--list-policies", action="store_true", help="list policies and exit")
    p.set_defaults(handler=cmd_simulate)

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


def cmd_simulate(args: argparse.Namespace) -> int:
    from mooncake_conductor.policies import policy_names
    from pydantic import ValidationError

    from .presets import PRESETS, speed_for_utilization
    from .trace import TraceError, load_trace

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
        policies = everything if args.compare == "all" else [
            p.strip() for p in args.compare.split(",") if p.strip()
        ]
    else:
        policies = [args.policy]
    unknown = [p for p in policies if p not in known]
    if unknown:
        return _fail(f"unknown policy {', '.join(unknown)}; known: {', '.join(known)}")
    if len(set(policies)) != len(policies):
        return _fail("a policy is listed twice in --compare")
    params: dict[str, Any] = {}
    if args.params:
        try:
            params = json.loads(args.params)
        except json.JSONDecodeError as exc:
            return _fail(f"--params is not valid JSON: {exc.msg}")
        if not isinstance(params, dict):
            return _fail("--params must be a JSON object")
    preset = None
    if args.preset:
        if args.preset not in PRESETS:
            return _fail(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
        preset = PRESETS[args.preset]
    for flag in ("prefill", "decode", "limit", "jobs"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            return _fail(f"--{flag} must be positive")
    for flag in ("speed", "ttft_slo", "tbt_slo"):
        v = getattr(args, flag)
        if v is not None and (not math.isfinite(v) or v <= 0):
            return _fail(f"--{flag.replace('_', '-')} must be a positive number")
    path = _trace_path(args.trace)
    try:
        records = load_trace(path, limit=args.limit)
    except TraceError as exc:
        return _fail(str(exc))

    prefill = args.prefill or (preset.prefill if preset else 16)
    decode = args.decode or (preset.decode if preset else 16)
    speed = args.speed
    if speed is None:
        speed = (speed_for_utilization(records, prefill, preset.target_utilization)
                 if preset else 1.0)
    ttft = args.ttft_slo or (preset.ttft_slo_s if preset else 30.0)
    tbt_ms = args.tbt_slo or (preset.tbt_slo_ms if preset else 100.0)
    cache = args.cache_tokens or (preset.prefill_cache_tokens if preset else 3_000_000)
    base: dict[str, Any] = {
        "prefill": prefill,
        "decode": decode,
        "speed": speed,
        "prefill_cache_tokens": cache,
        "store_tokens": args.store_tokens or 0,
    }
    configs = []
    try:
        from .engine import SimConfig

        for pol in policies:
            cfg = dict(base)
            cfg["conductor"] = {
                "policy": pol,
                "params": params if len(policies) == 1 or pol == "conductor" else {},
                "slo": {"ttft_s": ttft, "tbt_s": tbt_ms / 1000.0},
                "seed": args.seed,
            }
            SimConfig.model_validate(cfg).model_dump()
            configs.append(cfg)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        return _fail(f"bad setting {loc}: {err['msg']}")

    settings = {
        "trace": str(path),
        "requests": len(records),
        "preset": args.preset,
        **base,
        "ttft_slo_s": ttft,
        "tbt_slo_ms": tbt_ms,
        "block_tokens": 512,
        "cost_model": "LLaMA3-70B on 8xA800 (FAST'25 Table 1)",
        "seed": args.seed,
    }
    print(
        f"trace {path.name}: {len(records)} requests | {prefill} prefill + {decode} decode | "
        f"speed {speed:.3g}x | cache {cache:,} tokens/instance | "
        f"SLO TTFT {ttft:g} s, TBT {tbt_ms:g} ms",
        file=sys.stderr,
    )
    jobs = args.jobs or min(len(policies), os.cpu_count() or 1)
    progress = sys.stderr.isatty() or len(records) > 2000
    work = [(records, cfg, progress and jobs == 1) for cfg in configs]
    if jobs > 1 and len(work) > 1:
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


def _nan(x: Any) -> Any:
    raise TypeError(f"not JSON serialisable: {x!r}")


def format_table(results: list[dict[str, Any]]) -> str:
    ref = next((r for r in results if r["policy"] == "conductor"), None)
    cols = ["policy", "done", "rej", "TTFT mean", "p50", "p90", "p99", "TBT p90",
            "SLO ok", "hit", "GPU s", "TTFT/cond"]
    rows = []
    for r in results:
        ratio = (f"{r['ttft_mean_s'] / ref['ttft_mean_s']:.2f}x"
                 if ref and ref["ttft_mean_s"] else "–")  # no conductor run to compare
        rows.append([
            r["policy"], str(r["completed"]), str(r["rejected"]),
            f"{r['ttft_mean_s']:.2f} s", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p90_s']:.2f}",
            f"{r['ttft_p99_s']:.2f}", f"{r['tbt_p90_ms']:.1f} ms",
            f"{100 * r['slo_attainment']:.2f}%", f"{100 * r['token_hit_ratio']:.1f}%",
            f"{r['prefill_gpu_seconds']:,.0f}", ratio,
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                     enumerate(zip(cols, widths, strict=True)))
    out = [line, "-" * len(line)]
    for row in rows:
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in
                             enumerate(zip(row, widths, strict=True))))
    return "\n".join(out)


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
