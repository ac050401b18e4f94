"""``mooncake-operator conformance install|list``: the real engines' environments."""

from __future__ import annotations

import argparse
from typing import Any


def _log(message: str) -> None:
    print(message, flush=True)


def _envs(args: argparse.Namespace) -> list[Any]:
    from mooncake_operator.engines.support import RELEASES

    from .envs import EngineEnv
    from .settings import EngineEnvSettings

    settings = EngineEnvSettings()
    wanted = set(args.engines or ())
    envs = [EngineEnv(r.kind.value, r.version, settings) for r in RELEASES]
    unknown = wanted - {e.requirement for e in envs} - {e.engine for e in envs}
    if unknown:
        known = ", ".join(e.requirement for e in envs)
        raise SystemExit(f"not a supported engine release: {', '.join(sorted(unknown))} "
                         f"(supported: {known})")
    return [e for e in envs if not wanted or e.requirement in wanted or e.engine in wanted]


def _install(args: argparse.Namespace) -> int:
    from .envs import InstallError

    try:
        for env in _envs(args):
            env.install(_log)
    except InstallError as exc:
        print(f"conformance install: {exc}", flush=True)
        return 1
    return 0


def _list(args: argparse.Namespace) -> int:
    for env in _envs(args):
        print(env.describe())
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "conformance", help="install the supported real engines (vLLM, SGLang) for the "
        "conformance tests",
        description="The engine versions the operator supports, each in a virtual "
        "environment cached by version (no GPU needed). The checks are the tests in "
        "tests/conformance: python -m pytest tests/conformance")
    sub = parser.add_subparsers(dest="conformance_command", metavar="ACTION")
    sub.required = True
    for name, handler, text in (
        ("install", _install, "install every supported engine release (cached afterwards)"),
        ("list", _list, "the supported releases and whether each is installed"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("engines", nargs="*", metavar="ENGINE", help=(
            "only these (vllm, sglang==0.5.23, ...); default: all supported releases"))
        p.set_defaults(handler=handler)
