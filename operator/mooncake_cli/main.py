"""One CLI, ``mooncake-operator``, with a subcommand for every part of the project.

Each part owns a ``register(subparsers)`` function in its own module; this file only
lists them, so adding a part never means editing another part's code. Handlers import
their heavy dependencies lazily so ``mooncake-operator --help`` stays fast.

The same CLI is the ENTRYPOINT of both images. The worker image installs the project
without the operator's and the gateway's dependencies (``images/worker/``), so a part
whose package is absent is left out of the parser, and a subcommand whose dependencies
are not installed says so in one line instead of a traceback.
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

PROJECT_PREFIX = "mooncake_"


def _part_absent(module_name: str, exc: ModuleNotFoundError) -> bool:
    """True when the import failed because the part itself is not installed (not because
    something it imports is missing: that is a bug to surface)."""
    package = module_name.split(".", 1)[0]
    return exc.name in (package, module_name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-operator",
        description="KV-cache-centric LLM serving on Kubernetes (Mooncake Conductor).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if _part_absent(module_name, exc):
                continue
            raise
        module.register(sub)
    return parser


def missing_dependency_message(command: str, exc: ModuleNotFoundError) -> str | None:
    """The one line printed when a subcommand needs a third-party module that is not
    installed (e.g. ``operator run`` in the worker image); None for the project's own."""
    name = exc.name or ""
    if not name or name.startswith(PROJECT_PREFIX):
        return None
    return (f"mooncake-operator {command}: the Python module {name!r} is not installed "
            "here (the worker image carries only what `worker` and `store-node` need); "
            "run it from the operator image or a full install (pip install mooncake-operator)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = args.handler
    try:
        rc = handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        message = missing_dependency_message(args.command, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
