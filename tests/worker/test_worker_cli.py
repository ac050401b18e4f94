"""``mooncake-operator worker``'s command line: one settings object, one set of defaults."""

from __future__ import annotations

import argparse

import pytest
from mooncake_worker.cli import add_arguments, settings_from_args
from mooncake_worker.settings import WorkerSettings


def _parsed(*argv: str) -> WorkerSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(list(argv)))


def test_an_option_left_out_keeps_the_settings_default() -> None:
    """A default written into the parser as well drifts from the settings' (the step
    budget did: the command line kept 0 after the settings took vLLM's 8192)."""
    got, want = _parsed(), WorkerSettings()
    assert got.chunked_prefill_tokens == 8192
    assert [n for n in WorkerSettings.model_fields if getattr(got, n) != getattr(want, n)] == []


@pytest.mark.parametrize("tokens", [0, 2048])
def test_the_step_budget_is_set_from_the_command_line(tokens: int) -> None:
    assert _parsed("--chunked-prefill-tokens", str(tokens)).chunked_prefill_tokens == tokens
