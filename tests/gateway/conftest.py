"""Gateway test fixtures: a small cluster of fast workers behind one gateway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .gateway_fixtures import GatewayProc, WorkerProc, model_config, run_gateway, run_worker

FAST = ("--time-scale", "0", "--max-model-len", "16384")


@dataclass
class Cluster:
    gateway: GatewayProc
    prefill: list[WorkerProc]
    decode: list[WorkerProc]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """2 prefill + 1 decode fast workers, one gateway (model llama3-70b-sim)."""
    with run_worker(*FAST, "--role", "prefill") as p0, \
            run_worker(*FAST, "--role", "prefill") as p1, \
            run_worker(*FAST, "--role", "decode") as d0:
        model = model_config([p0, p1], [d0], max_model_len=16384)
        with run_gateway([model]) as g:
            yield Cluster(g, [p0, p1], [d0])
