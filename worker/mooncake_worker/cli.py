"""``mooncake-operator worker``: run a simulated engine (and, optionally, the pod agent)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from pydantic import ValidationError

from .settings import Role, WorkerSettings


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = WorkerSettings.model_fields
    p.add_argument("--role", choices=[r.value for r in Role], default=Role.BOTH.value)
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="0: pick a free port")
    p.add_argument("--model", default=d["model"].default)
    p.add_argument("--kv-events-port", type=int, default=None, help="ZMQ PUB port for KV events")
    p.add_argument("--kv-replay-port", type=int, default=None, help="ZMQ ROUTER replay port")
    p.add_argument("--kv-events-host", default=d["kv_events_host"].default)
    p.add_argument("--kv-events-topic", default="")
    p.add_argument("--kv-buffer-steps", type=int, default=d["kv_buffer_steps"].default)
    p.add_argument("--store", dest="store_master", default=None,
                   help="mooncake_master RPC address host:port (enables the store handoff)")
    p.add_argument("--store-metadata", default=None,
                   help="metadata server URL, or P2PHANDSHAKE (peers handshake directly)")
    p.add_argument("--store-local-hostname", default=d["store_local_hostname"].default)
    p.add_argument("--store-connect-timeout", dest="store_connect_timeout_s", type=float,
                   default=d["store_connect_timeout_s"].default)
    p.add_argument("--store-timeout", dest="store_timeout_s", type=float,
                   default=d["store_timeout_s"].default,
                   help="seconds a request waits for one store call before recomputing")
    p.add_argument("--store-batch-blocks", type=int, default=d["store_batch_blocks"].default,
                   help="most blocks in one store call (larger requests are split)")
    p.add_argument("--store-calls-in-flight", type=int,
                   default=d["store_calls_in_flight"].default,
                   help="most store calls at once (the binding loses transfers past "
                   "about a thousand objects in flight)")
    p.add_argument("--store-payload-scale", type=float,
                   default=d["store_payload_scale"].default)
    p.add_argument("--time-scale", type=float, default=d["time_scale"].default,
                   help="1.0 = LLaMA3-70B on 8xA800 in real time; 0 = no sleeping")
    p.add_argument("--block-size", type=int, default=d["block_size"].default)
    p.add_argument("--cache-salt", default=None,
                   help="salt folded into the block-key namespace (the gateway's must match)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="KV cache capacity in tokens (default: from the cost model)")
    p.add_argument("--chunked-prefill-tokens", type=int,
                   default=d["chunked_prefill_tokens"].default,
                   help="prefill tokens per engine step at most (vLLM's max_num_batched_tokens; "
                   "0: every admitted prompt whole in one step)")
    p.add_argument("--prefill-noise", type=float, default=d["prefill_noise"].default,
                   help="sigma of a per-request log-normal factor on prefill time (0: exactly "
                   "the cost model; the scheduler's predictions are then perfect)")
    p.add_argument("--noise-seed", type=int, default=d["noise_seed"].default)
    p.add_argument("--max-running", type=int, default=d["max_running"].default)
    p.add_argument("--max-waiting", type=int, default=d["max_waiting"].default)
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"].default)
    p.add_argument("--default-max-tokens", type=int, default=d["default_max_tokens"].default)
    p.add_argument("--max-body-bytes", type=int, default=d["max_body_bytes"].default)
    p.add_argument("--annotations-file", default=None,
                   help="downward-API annotations file; enables the pod agent")
    p.add_argument("--agent-poll", dest="agent_poll_s", type=float,
                   default=d["agent_poll_s"].default)
    p.add_argument("--engine-url", default=None,
                   help="relay mode: front this real engine (e.g. vLLM) instead of simulating")
    p.add_argument("--engine-kv-events", default=None,
                   help="relay mode: the engine's KV-event endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--engine-kv-replay", default=None,
                   help="relay mode: the engine's KV-event replay endpoint")
    p.add_argument("--engine-kind", choices=["vllm", "sglang"],
                   default=d["engine_kind"].default,
                   help="relay mode: the engine it fronts (how warm-ups are sent)")
    p.add_argument("--agent-rewarm", dest="agent_rewarm_s", type=float,
                   default=d["agent_rewarm_s"].default)
    p.add_argument("--no-warm-kernels", dest="warm_kernels", action="store_const",
                   const=False, default=None,
                   help="skip compiling the block-key loop before serving")
    p.add_argument("--log-level", default="WARNING")


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    fields = set(WorkerSettings.model_fields)
    values: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k in fields and v is not None
    }
    if values.get("port") == 0:
        values["port"] = _free_port(values.get("host", "127.0.0.1"))
    return WorkerSettings(**values)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"invalid worker settings:\n{exc}", file=sys.stderr)
        return 2
    from .server import serve

    def ready(port: int) -> None:
        print(f"worker ready on http://{settings.host}:{port}", flush=True)

    from mooncake_contract.lifecycle import run_until_stopped

    from .store import StoreError

    try:
        run_until_stopped(lambda: serve(settings, ready))
    except (StoreError, OSError) as exc:  # store unreachable, port taken, ...
        print(f"worker failed to start: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "worker",
        help="simulated vLLM-compatible engine + pod agent",
        description="Simulated LLM engine speaking vLLM's wire formats (OpenAI API, KV events, "
        "metrics, P/D handshake), with an optional Mooncake Store handoff and pod agent.",
    )
    add_arguments(p)
    p.set_defaults(handler=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake-worker")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["worker", *(argv if argv is not None else sys.argv[1:])])
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
