"""One CLI, ``mooncake-operator``, with a subcommand for every part of the project.

Each part owns a ``register(subparsers)`` function in its own module; this file only
lists them with the subcommands each registers, so adding a part never means editing
another part's code. A command line that names a subcommand imports that part alone
(``simulate`` never pays for the worker's or the local cluster's imports, which the
capacity search's many replays and a container's start-up feel); ``--help`` and an
unknown name import every part. Handlers import their heavy dependencies lazily.

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
from typing import Any

#: module -> the subcommands its ``register(subparsers) -> None`` adds (a test holds the
#: names equal to what each module registers)
SUBCOMMANDS: dict[str, tuple[str, ...]] = {
    "mooncake_sim.cli": ("simulate", "capacity", "trace-stats"),
    "mooncake_localcluster.cli": ("local-cluster",),
    "mooncake_worker.cli": ("worker",),
    "mooncake_worker.storenode": ("store-node",),
    "mooncake_gateway.cli": ("gateway", "replay"),
    "mooncake_operator.cli": ("operator",),
    "mooncake_cli.demo": ("demo",),
    "mooncake_conformance.cli": ("conformance",),
    "mooncake_monitoring.cli": ("monitoring",),
}
SUBCOMMAND_MODULES: tuple[str, ...] = tuple(SUBCOMMANDS)

PROJECT_PREFIX = "mooncake_"


def _part_absent(module_name: str, exc: ModuleNotFoundError) -> bool:
    """True when the import failed because the part itself is not installed (not because
    something it imports is missing: that is a bug to surface)."""
    package = module_name.split(".", 1)[0]
    return exc.name in (package, module_name)


def module_of(argv: Sequence[str]) -> str | None:
    """The one module that serves this command line, or None when it names no known
    subcommand first (``--help``, a typo): then every part is registered."""
    first = argv[0] if argv else ""
    for module_name, commands in SUBCOMMANDS.items():
        if first in commands:
            return module_name
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every part's subcommands, or ``only`` that module's (when it is
    installed; else every part's, so argparse names the choices there are)."""
    parser = argparse.ArgumentParser(
        prog="mooncake-operator",
        description="KV-cache-centric LLM serving on Kubernetes (Mooncake Conductor).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    if only is not None and _register(sub, only):
        return parser
    for module_name in SUBCOMMAND_MODULES:
        _register(sub, module_name)
    return parser


def _register(sub: Any, module_name: str) -> bool:
    """Add one part's subcommands; False when the part is not installed."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _part_absent(module_name, exc):
            return False
        raise
    module.register(sub)
    return True


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
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(module_of(argv))
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
