"""`python -m mooncake_localcluster ACTION`: the `local-cluster` subcommand alone."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mooncake_localcluster.cli import register


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mooncake_localcluster")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    args = parser.parse_args(["local-cluster", *(sys.argv[1:] if argv is None else argv)])
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
