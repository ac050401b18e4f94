"""Every engine series the gateway reads (and that our simulated engine claims to export
in vLLM's name) exists under that name and type in the release's own metric definitions:
vLLM's ``PrometheusStatLogger``, SGLang's scheduler, tokenizer, storage and radix-cache
collectors, instantiated on the configuration of a generated pod."""

from __future__ import annotations

from typing import Any

import pytest
from mooncake_conformance import runner
from mooncake_gateway.enginemetrics import SERIES, VLLM_CACHE_INFO
from mooncake_operator.engines import RELEASES, EngineRelease
from mooncake_worker.metrics import WorkerMetrics
from mooncake_worker.settings import WorkerSettings
from prometheus_client.parser import text_string_to_metric_families

from .conftest import installed
from .matrix import Case

_SERIES: dict[str, dict[str, Any]] = {}


def _engine_series(release: EngineRelease) -> dict[str, Any]:
    key = release.name
    if key not in _SERIES:
        env = installed(release)
        built = Case(release, store=False, protocol="tcp", block_size=16, tp=1,
                     role="prefill").build()
        got = runner.run(env, "metrics", {"pod": built.engine.probe_pod()})
        assert got["ok"], got
        _SERIES[key] = got["series"]
    return _SERIES[key]


def test_the_series_the_gateway_reads_exist(release: EngineRelease) -> None:
    series = _engine_series(release)
    prefix = f"{release.kind.value}:"
    wanted = [name for name in SERIES if name.startswith(prefix)]
    assert wanted, f"the gateway reads nothing of {release.name}"
    missing = [name for name in wanted if name not in series]
    assert missing == [], f"{release.name} has no {missing}"
    if release.kind.value == "vllm":
        info = series[VLLM_CACHE_INFO]
        assert {"block_size", "num_gpu_blocks"} <= set(info["labels"])


@pytest.mark.parametrize("vllm", [r for r in RELEASES if r.kind.value == "vllm"],
                         ids=lambda r: r.name.replace(" ", "-"))
def test_the_simulated_engine_exports_vllm_series_as_vllm_does(vllm: EngineRelease) -> None:
    series = _engine_series(vllm)
    ours = WorkerMetrics(WorkerSettings(model="m")).render().decode()
    for fam in text_string_to_metric_families(ours):
        for sample in fam.samples:
            if not sample.name.startswith("vllm:") or sample.name.endswith("_created"):
                continue
            assert sample.name in series, f"vLLM has no {sample.name}"
            theirs = series[sample.name]["type"]
            assert theirs in (fam.type, "gauge" if fam.type == "unknown" else fam.type), \
                (sample.name, fam.type, theirs)
