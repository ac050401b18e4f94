"""The simulated engine schedules its steps as vLLM's defaults would on the cost model's
GPU: the step budget it runs with unless told otherwise is the one ``vllm serve`` picks,
read from vLLM's own ``EngineArgs.get_batch_defaults``."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_conductor.cost import CostModelConfig
from mooncake_conformance import runner
from mooncake_worker.settings import WorkerSettings

from .conftest import installed
from .matrix import RELEASE_IDS

VLLM = sorted(k for k, r in RELEASE_IDS.items() if r.kind.value == "vllm")
HW = CostModelConfig().hardware
#: the cost model's GPU (paper Table 1: 8 x A800 80GB), as CUDA names it
A800 = {"device_name": "NVIDIA A800-SXM4-80GB", "capability": [8, 0],
        "memory_bytes": HW.hbm_gb_per_gpu * 1e9, "world_size": HW.gpus}
#: the same call for other GPUs: the answer comes from the device described, not this host
A100 = {**A800, "device_name": "NVIDIA A100-SXM4-80GB"}
SMALL = {**A800, "memory_bytes": 40e9}


@pytest.fixture(scope="module", params=VLLM)
def defaults(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    got = runner.run(installed(RELEASE_IDS[request.param]), "batch_defaults",
                     {"devices": [A800, A100, SMALL]})
    assert got["ok"], got
    return list(got["defaults"])


def test_the_step_budget_is_vllms_default_on_the_cost_models_gpu(
        defaults: list[dict[str, Any]]) -> None:
    assert WorkerSettings().chunked_prefill_tokens == defaults[0]["max_num_batched_tokens"]


def test_the_probe_reads_the_device_it_is_given(defaults: list[dict[str, Any]]) -> None:
    a800, a100, small = (d["max_num_batched_tokens"] for d in defaults)
    assert a100 < a800
    assert small == a100
