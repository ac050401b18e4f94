"""The worker compiles its block-key loop before it serves (``warm_kernels``), so the
first long prompt does not wait for numba."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from mooncake_worker import server
from mooncake_worker.cli import add_arguments, settings_from_args
from mooncake_worker.server import Worker
from worker_inproc import serving, settings


@pytest.mark.parametrize("warm", [True, False])
def test_block_keys_are_warmed_before_serving_unless_turned_off(
        monkeypatch: pytest.MonkeyPatch, warm: bool) -> None:
    calls: list[str] = []
    monkeypatch.setattr(server, "warm_block_keys", lambda: calls.append("warm"))

    async def main() -> tuple[list[str], int]:
        async with serving(Worker(settings(warm_kernels=warm))) as client:
            before = list(calls)  # start-up is over: the warm-up came before any request
            answer = await client.get("/health")
            return before, answer.status

    before, status = asyncio.run(main())
    assert status == 200
    assert before == (["warm"] if warm else [])


def test_the_command_line_turns_the_warm_up_off() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([])).warm_kernels is True
    assert settings_from_args(parser.parse_args(["--no-warm-kernels"])).warm_kernels is False
