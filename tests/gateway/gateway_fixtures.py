"""Gateway subprocesses in front of worker subprocesses, all on 127.0.0.1.

The harness lives in :mod:`mooncake_testbed.procs` (benchmarks use it too); the tests
import it from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mooncake_testbed.procs import (
    HOST,
    MODEL,
    START_TIMEOUT_S,
    GatewayProc,
    Master,
    WorkerProc,
    endpoint,
    free_port,
    http_json,
    model_config,
    run_gateway,
    run_worker,
    wait_for,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker"))

from worker_fixtures import mooncake_master

__all__ = ["HOST", "MODEL", "START_TIMEOUT_S", "GatewayProc", "Master", "WorkerProc",
           "endpoint", "free_port", "http_json", "model_config", "mooncake_master",
           "run_gateway", "run_worker", "wait_for"]
