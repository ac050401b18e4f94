"""``mooncake-operator local-cluster build|up|down|status|kubeconfig``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _settings(args: argparse.Namespace) -> Any:
    from mooncake_localcluster.settings import LocalClusterSettings

    overrides: dict[str, Any] = {}
    if getattr(args, "name", None):
        overrides["name"] = args.name
    if getattr(args, "state_dir", None):
        overrides["state_dir"] = Path(args.state_dir)
    if getattr(args, "prefill_nodes", None) is not None:
        overrides["prefill_nodes"] = args.prefill_nodes
    if getattr(args, "decode_nodes", None) is not None:
        overrides["decode_nodes"] = args.decode_nodes
    return LocalClusterSettings(**overrides)


def _log(message: str) -> None:
    print(message, flush=True)


def _build(args: argparse.Namespace) -> int:
    from mooncake_localcluster import components

    names = tuple(args.components) if args.components else None
    components.build_all(_settings(args), names, _log)
    return 0


def _up(args: argparse.Namespace) -> int:
    from mooncake_localcluster import cluster

    cluster.up(_settings(args), _log)
    return 0


def _down(args: argparse.Namespace) -> int:
    from mooncake_localcluster import cluster

    settings = _settings(args)
    cluster.down(settings, _log)
    if args.purge:
        cluster.purge(settings, _log)
    return 0


def _status(args: argparse.Namespace) -> int:
    from mooncake_localcluster import cluster

    data = cluster.status(_settings(args))
    print(cluster.format_status(data))
    return 0 if data["running"] else 1


def _kubeconfig(args: argparse.Namespace) -> int:
    from mooncake_localcluster import cluster

    print(cluster.state_paths(_settings(args)).kubeconfig)
    return 0


def _pod_runner(args: argparse.Namespace) -> int:
    from mooncake_localcluster import podrunner

    return podrunner.main(Path(args.state_dir))


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="cluster name (default: 'default')")
    parser.add_argument("--state-dir", help="state directory (default: cache/state/<name>)")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "local-cluster",
        help="embedded Kubernetes control plane with fake GPU nodes",
        description="etcd + kube-apiserver + controller-manager + scheduler + kwok on 127.0.0.1",
    )
    sub = parser.add_subparsers(dest="local_cluster_command", metavar="ACTION")
    sub.required = True

    build = sub.add_parser("build", help="build the pinned Go binaries into the cache")
    build.add_argument("components", nargs="*", help="only these components")
    build.set_defaults(handler=_build)

    up = sub.add_parser("up", help="start the cluster (builds first if needed)")
    _common(up)
    up.add_argument("--prefill-nodes", type=int, help="number of prefill-pool GPU nodes")
    up.add_argument("--decode-nodes", type=int, help="number of decode-pool GPU nodes")
    up.set_defaults(handler=_up)

    down = sub.add_parser("down", help="stop every process of the cluster")
    _common(down)
    down.add_argument(
        "--purge", action="store_true", help="also delete the state dir (etcd data, certs, logs)"
    )
    down.set_defaults(handler=_down)

    status = sub.add_parser("status", help="what is running, ports, memory")
    _common(status)
    status.set_defaults(handler=_status)

    kubeconfig = sub.add_parser("kubeconfig", help="print the kubeconfig path")
    _common(kubeconfig)
    kubeconfig.set_defaults(handler=_kubeconfig)

    runner = sub.add_parser("pod-runner", help=argparse.SUPPRESS)
    runner.add_argument("--state-dir", required=True)
    runner.set_defaults(handler=_pod_runner)
