"""``gateway`` and ``replay`` subcommands of ``mooncake-operator``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .settings import GatewaySettings

DEFAULT_MAX_OUTPUT = 64
EXIT_BAD_INPUT = 2
#: the replay's API key for a locked gateway (from the environment: never on a command line)
API_KEY_ENV = "MOONCAKE_API_KEY"


def register(subparsers: Any) -> None:
    g = subparsers.add_parser(
        "gateway", help="KV-cache-aware OpenAI-compatible gateway (Conductor in-process)",
        description="Serve /v1/completions and /v1/chat/completions for one or more models, "
        "routing each request with the Conductor (prefill then decode) from the engines' KV "
        "events and load.")
    g.add_argument("--config", default=None,
                   help="gateway settings, YAML or JSON (optional with --kubernetes-models)")
    g.add_argument("--kubernetes-models", action="store_true",
                   help="serve the models of the ConfigMaps labelled "
                   "mooncake.io/gateway-model=true (list + watch; in-cluster config, else "
                   "KUBECONFIG)")
    g.add_argument("--namespace", default=None,
                   help="with --kubernetes-models: only this namespace (default: all)")
    g.add_argument("--host", default=None, help="override the bind address")
    g.add_argument("--port", type=int, default=None, help="override the port (0: free one)")
    g.add_argument("--log-level", default="WARNING")
    g.set_defaults(handler=run_gateway)

    r = subparsers.add_parser(
        "replay", help="replay a Mooncake trace against a live gateway, measured client-side",
        description="Send a Mooncake-format trace's requests (token-id prompts sharing the "
        "trace's prefixes) to a gateway on the trace's clock; report TTFT/TBT/SLO attainment "
        "with the same JSON keys as `simulate`. A gateway that asks for API keys: put one "
        f"in ${API_KEY_ENV} (an admin key also reads the hit ratio from /conductor/state).")
    r.add_argument("--trace", default=None, help="trace file (default: bundled conversation)")
    r.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8080")
    r.add_argument("--speed", type=float, default=1.0, help="replay speed (x the trace's clock)")
    r.add_argument("--limit", type=int, default=None, help="first N requests only")
    r.add_argument("--json", dest="json_out", default=None, help="write results as JSON")
    r.add_argument("--model", default=None, help="model name (default: the gateway's first)")
    r.add_argument("--max-output-tokens", type=int, default=DEFAULT_MAX_OUTPUT,
                   help="cap on max_tokens (output_length otherwise)")
    r.add_argument("--time-scale", type=float, default=1.0,
                   help="the engines' --time-scale: measured times are divided by it")
    r.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO, seconds")
    r.add_argument("--tbt-slo", type=float, default=100.0, help="TBT SLO, milliseconds")
    r.add_argument("--timeout", type=float, default=600.0, help="per-request limit, seconds")
    r.add_argument("--retries", type=int, default=2,
                   help="send a request again, at most this often, when its connection "
                   "failed before any answer came (the OpenAI Python client's default; "
                   "a stream that had begun is never sent again)")
    r.add_argument("--counter-sample", type=float, default=0.0, metavar="SECONDS",
                   help="also read the gateway's counters this often during the run, so a "
                   "gateway restart loses less (0: before and after only; each read costs "
                   "the gateway a state build)")
    r.set_defaults(handler=run_replay)


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    """The ``GatewaySettings`` the ``gateway`` command's arguments describe: the file's
    (if any), then ``--host``/``--port``, then ``--kubernetes-models`` and ``--namespace``
    on top of the file's other ``kubernetes_models`` settings. ``ValueError`` for a
    combination that makes no sense."""
    from .settings import GatewaySettings, KubernetesModels

    if args.config is None and not args.kubernetes_models:
        raise ValueError("give --config, --kubernetes-models or both")
    if args.namespace is not None and not args.kubernetes_models:
        raise ValueError("--namespace goes with --kubernetes-models")
    if args.config is not None:
        settings = GatewaySettings.from_file(args.config, host=args.host, port=args.port)
    else:
        settings = GatewaySettings.model_validate(
            {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    if args.kubernetes_models:
        km = settings.kubernetes_models or KubernetesModels()
        if args.namespace is not None:
            km = km.model_copy(update={"namespace": args.namespace})
        settings = settings.model_copy(update={"kubernetes_models": km})
    return settings


def run_gateway(args: argparse.Namespace) -> int:
    import logging

    from mooncake_contract.lifecycle import run_until_stopped
    from pydantic import ValidationError

    from .server import loop_factory, serve

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = gateway_settings(args)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"invalid gateway settings: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    def ready(port: int) -> None:
        print(f"gateway ready on http://{settings.host}:{port}", flush=True)

    try:
        run_until_stopped(lambda: serve(settings, ready), loop_factory(settings))
    except (OSError, RuntimeError) as exc:
        print(f"gateway failed to start: {exc}", file=sys.stderr)
        return 1
    return 0


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


def run_replay(args: argparse.Namespace) -> int:
    import asyncio

    from mooncake_sim.trace import TraceError, bundled_trace, load_trace

    from .replay import ReplayConfig, ReplayError, replay

    if args.speed <= 0 or args.time_scale <= 0 or args.max_output_tokens <= 0:
        print("--speed, --time-scale and --max-output-tokens must be positive", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.counter_sample < 0 or args.retries < 0:
        print("--counter-sample and --retries must be 0 or positive", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        records = load_trace(args.trace or bundled_trace(), limit=args.limit)
    except TraceError as exc:
        print(f"bad trace: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cfg = ReplayConfig(url=args.url.rstrip("/"), model=args.model, speed=args.speed,
                       max_output_tokens=args.max_output_tokens, time_scale=args.time_scale,
                       ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo / 1000.0,
                       timeout_s=args.timeout, sample_s=args.counter_sample,
                       retries=args.retries, api_key=os.environ.get(API_KEY_ENV) or None)
    try:
        res = asyncio.run(replay(records, cfg))
    except OSError as exc:
        print(f"cannot reach the gateway: {exc}", file=sys.stderr)
        return 1
    except ReplayError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 1
    settings = {"trace": str(args.trace or "bundled:conversation"), "url": cfg.url,
                "model": cfg.model, "speed": cfg.speed, "limit": args.limit,
                "max_output_tokens": cfg.max_output_tokens, "time_scale": cfg.time_scale,
                "ttft_slo_s": cfg.ttft_slo_s, "tbt_slo_s": cfg.tbt_slo_s}
    out = {"settings": settings, "results": [_clean(res)]}
    print(f"{res['policy']}: {res['completed']}/{res['requests']} done, "
          f"{res['rejected']} rejected, {res['failed']} failed, {res['retried']} "
          f"sent again; TTFT mean "
          f"{res['ttft_mean_s']:.3f} s p90 {res['ttft_p90_s']:.3f} s; TBT p90 "
          f"{res['tbt_p90_ms']:.1f} ms; SLO {100 * res['slo_attainment']:.1f}%; hit "
          f"{100 * res['token_hit_ratio']:.1f}%; wall {res['wall_seconds']:.1f} s")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0
