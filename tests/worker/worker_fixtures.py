"""Fixtures: worker subprocesses on free 127.0.0.1 ports, a real mooncake_master.

The process harness itself lives in :mod:`mooncake_testbed.procs` (benchmarks use it too);
this module re-exports it under the names the tests use and adds the pytest fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from mooncake_testbed.procs import (
    HOST,
    Master,
    Unavailable,
    WorkerProc,
    free_port,
    http_json,
    run_master,
    run_worker,
    stop_process,
    worker_command,
)

from tests.needs import missing

__all__ = ["HOST", "Master", "WorkerProc", "free_port", "http_json", "mooncake_master",
           "run_worker", "stop_process", "worker", "worker_command"]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    """A fast (time-scale 0) worker shared by a test module."""
    with run_worker("--time-scale", "0", "--max-model-len", "4096") as w:
        yield w


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[Master]:
    """A real mooncake_master; fails with the install line when it is missing."""
    try:
        ctx = run_master()
        master = ctx.__enter__()
    except Unavailable as err:
        missing("store", str(err))
    try:
        yield master
    finally:
        ctx.__exit__(None, None, None)
