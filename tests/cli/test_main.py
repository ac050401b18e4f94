"""The one CLI's dispatch: a command line that names a subcommand registers (and imports)
only the part that serves it; ``--help`` and unknown names see every part."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest
from mooncake_cli.main import SUBCOMMANDS, build_parser, main, module_of


def _choices(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


@pytest.mark.parametrize("module_name", sorted(SUBCOMMANDS))
def test_declared_names_are_what_each_module_registers(module_name: str) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    importlib.import_module(module_name).register(sub)
    assert set(sub.choices) == set(SUBCOMMANDS[module_name])


def test_every_name_belongs_to_one_module() -> None:
    names = [n for commands in SUBCOMMANDS.values() for n in commands]
    assert len(names) == len(set(names))


def test_module_of_picks_the_part_of_the_first_word() -> None:
    assert module_of(["simulate", "--preset", "paper-fig5"]) == "mooncake_sim.cli"
    assert module_of(["replay", "--help"]) == "mooncake_gateway.cli"
    assert module_of(["--help"]) is None
    assert module_of(["simulat"]) is None
    assert module_of([]) is None


def test_a_named_part_alone_and_every_part_otherwise() -> None:
    assert _choices(build_parser("mooncake_sim.cli")) == {"simulate", "capacity",
                                                          "trace-stats"}
    every = {n for commands in SUBCOMMANDS.values() for n in commands}
    assert _choices(build_parser()) == every


def test_an_unknown_command_lists_every_choice(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulat"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'simulat'" in err
    assert "simulate" in err and "store-node" in err and "operator" in err


def test_simulate_does_not_import_other_parts() -> None:
    code = (
        "import json, sys\n"
        "from mooncake_cli.main import main\n"
        "rc = main(['trace-stats'])\n"
        "print(json.dumps({'rc': rc, 'mods': sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('mooncake_worker', 'mooncake_localcluster', "
        "'mooncake_gateway', 'mooncake_operator', 'aiohttp', 'kopf'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["rc"] == 0
    assert doc["mods"] == []
