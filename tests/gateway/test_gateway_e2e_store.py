"""End to end: gateway + 4 prefill + 4 decode workers sharing a real Mooncake Store, the
bundled conversation trace replayed with ``mooncake-operator replay``.

Worker time runs at ``TIME_SCALE`` (modelled seconds × 0.1) and the replay at
``SPEED / TIME_SCALE``, so the modelled load equals the trace at ``SPEED``× its real
rate (about 90 % busy prefill pool with 4 instances): about 30 s per policy after a
warm-up pass that fills the store (about 3 minutes in all on 2 CPU cores). Each policy
starts from empty prefix caches. Prefill workers run one prompt at a time (FIFO), the
paper's prefill instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from .gateway_fixtures import (
    Master,
    WorkerProc,
    model_config,
    mooncake_master,
    run_gateway,
    run_worker,
)

__all__ = ["mooncake_master"]

TIME_SCALE = 0.1
SPEED = 0.5
REQUESTS = 300
MAX_OUTPUT = 16
# conductor first: later passes cannot give it an advantage from a warmer machine
POLICIES = ("conductor", "random", "round-robin")
WARMUP_SPEED = 4.0
HIT_TOLERANCE = 0.03
REPLAY_TIMEOUT_S = 300
pytestmark = [pytest.mark.store, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workers(mooncake_master: Master) -> Iterator[tuple[list[WorkerProc], list[WorkerProc]]]:
    store = ("--store", mooncake_master.rpc, "--store-metadata", mooncake_master.metadata)
    common = ("--time-scale", str(TIME_SCALE), "--max-model-len", "131072", *store)
    with contextlib.ExitStack() as stack:
        # one prompt at a time per prefill worker: FIFO, the paper's prefill instance
        prefill = [stack.enter_context(run_worker(*common, "--role", "prefill",
                                                  "--max-running", "1"))
                   for _ in range(4)]
        decode = [stack.enter_context(run_worker(*common, "--role", "decode"))
                  for _ in range(4)]
        yield prefill, decode


def _hits(ws: list[WorkerProc]) -> tuple[float, float]:
    return (sum(w.metric("vllm:prefix_cache_hits_total") for w in ws),
            sum(w.metric("vllm:prefix_cache_queries_total") for w in ws))


def _replay(url: str, speed: float = SPEED) -> dict[str, Any]:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mooncake_cli", "replay", "--url", url,
             "--limit", str(REQUESTS), "--speed", str(speed / TIME_SCALE),
             "--time-scale", str(TIME_SCALE), "--max-output-tokens", str(MAX_OUTPUT),
             "--json", out],
            capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr
        with open(out) as f:
            data = json.load(f)
    finally:
        os.unlink(out)
    assert set(data) == {"settings", "results"}
    return dict(data["results"][0])


def test_every_policy_serves_the_replay_and_predicts_the_workers_hit_ratio(
    workers: tuple[list[WorkerProc], list[WorkerProc]],
) -> None:
    prefill, decode = workers
    results: dict[str, dict[str, Any]] = {}
    # warm-up pass (not measured): the prefill workers put every prompt block into the
    # store once; those puts cost seconds of CPU that would otherwise land on one policy
    with run_gateway([model_config(prefill, decode, max_model_len=131072,
                                   conductor={"policy": "round-robin"})],
                     time_scale=TIME_SCALE, health_timeout_s=5, connect_timeout_s=10) as g:
        _replay(g.url, WARMUP_SPEED)
    for policy in POLICIES:
        for w in prefill + decode:
            w.post("/reset_prefix_cache", {})
        model = model_config(prefill, decode, max_model_len=131072,
                             conductor={"policy": policy})
        with run_gateway([model], time_scale=TIME_SCALE, health_timeout_s=5,
                         connect_timeout_s=10) as g:
            h0, q0 = _hits(prefill)
            res = _replay(g.url)
            h1, q1 = _hits(prefill)
        res["worker_hit_ratio"] = (h1 - h0) / (q1 - q0)
        results[policy] = res
        print(policy, json.dumps(res))
    for policy, res in results.items():
        assert res["requests"] == REQUESTS
        assert res["failed"] == 0, res["errors"]
        assert res["completed"] + res["rejected"] == REQUESTS
        # what the gateway predicted from its index ~ what the prefill engines reused
        assert abs(res["token_hit_ratio_predicted"] - res["worker_hit_ratio"]) < HIT_TOLERANCE, \
            (policy, res)
        # what the engines reported per request (seen by the gateway) = their counters
        assert abs(res["token_hit_ratio"] - res["worker_hit_ratio"]) < HIT_TOLERANCE, (policy, res)
    # which policy is faster is a measurement, not a test: benchmarks/gateway_e2e.py runs
    # this setting side by side (on a loaded 2-core host the TTFT order here flipped)
