"""``mooncake-operator monitoring``: the chart's monitoring for a Prometheus without the
Prometheus Operator, alert drills, and the dashboard rendered to PNG."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_DASHBOARD = Path("charts/mooncake-operator/files/dashboard.json")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "monitoring", help="Prometheus scrape config, alert-rule drills, dashboard PNGs",
        description="Monitoring without the Prometheus Operator (docs/monitoring.md).")
    sub = parser.add_subparsers(dest="monitoring_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("scrape-config", help="the chart's ServiceMonitor and PodMonitor as a "
                       "prometheus.yml (reads `helm template` output)")
    p.add_argument("manifests", nargs="?", default="-",
                   help="rendered chart (YAML stream); default: stdin")
    p.add_argument("--role", choices=("endpoints", "pod"), default="endpoints",
                   help="discover Endpoints (a real cluster) or the pods behind each Service "
                   "(clusters without Endpoints, such as the embedded one)")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig for Prometheus' discovery (default: in-cluster)")
    p.add_argument("--sd-file", default=None,
                   help="discover from this file instead (written by mooncake_monitoring."
                   "kubesd; for a Prometheus built without Kubernetes discovery; role pod)")
    p.add_argument("--rule-file", action="append", default=[], help="add to rule_files")
    p.set_defaults(handler=_scrape_config)

    p = sub.add_parser("rules", help="the alert rules, optionally on a faster clock for drills")
    p.add_argument("rules", help="rules file (charts/mooncake-operator/files/alerts.yaml)")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="divide every `for` and range window by this (default 1: as shipped)")
    p.set_defaults(handler=_rules)

    p = sub.add_parser("render", help="the Grafana dashboard's panels from a Prometheus, "
                       "as PNG files and an index.md")
    p.add_argument("--prometheus", required=True, help="Prometheus URL")
    p.add_argument("--since", default="15m", help="how far back (Prometheus duration)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    p.add_argument("--model", default=".*", help="the dashboard's $model (a regex)")
    p.add_argument("--rate-interval", default="1m", help="the dashboard's $__rate_interval")
    p.add_argument("--step", type=float, default=15.0, help="seconds between points")
    p.set_defaults(handler=_render)


def _scrape_config(args: argparse.Namespace) -> int:
    import yaml  # handlers import their dependencies: the worker image has no PyYAML

    from .scrapeconfig import Discovery, scrape_config

    text = sys.stdin.read() if args.manifests == "-" else Path(args.manifests).read_text()
    try:
        cfg = scrape_config([d for d in yaml.safe_load_all(text) if d], role=args.role,
                            disc=Discovery(args.kubeconfig, args.sd_file),
                            rule_files=args.rule_file or None)
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(cfg, sort_keys=False), end="")
    return 0


def _rules(args: argparse.Namespace) -> int:
    import yaml

    from .rules import compress

    rules = yaml.safe_load(Path(args.rules).read_text())
    try:
        out = compress(rules, args.speedup) if args.speedup != 1 else rules
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(out, sort_keys=False), end="")
    return 0


def _render(args: argparse.Namespace) -> int:
    from . import dashboard
    from .promapi import PromError
    from .rules import seconds

    if not args.dashboard.is_file():
        print(f"error: no dashboard at {args.dashboard} (--dashboard)", file=sys.stderr)
        return 2
    end = time.time()
    try:
        start = end - seconds(args.since)
        rep = dashboard.render(args.prometheus, start, end, args.out, step=args.step,
                               model=args.model, rate_interval=args.rate_interval,
                               dashboard=json.loads(args.dashboard.read_text()))
    except (ValueError, PromError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(rep.panels)} panels -> {args.out / 'index.md'}")
    return 0
