"""One CLI, ``mooncake-operator``, with a subcommand for every part of the project.

Each part owns a ``register(subparsers)`` function in its own module; this file only
lists them, so adding a part never means editing another part's code. Handlers import
their heavy dependencies lazily so ``mooncake-operator --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module, attribute) pairs; each attribute is ``register(subparsers) -> None``.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "mooncake_sim.cli",
    "mooncake_localcluster.cli",
    "mooncake_worker.cli",
    "mooncake_worker.storenode",
    "mooncake_gateway.cli",
    "mooncake_operator.cli",
    "mooncake_cli.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-operator",
        description="KV-cache-centric LLM serving on Kubernetes (Mooncake Conductor).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in SUBCOMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    try:
        rc = handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
