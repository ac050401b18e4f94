"""The published GPU calibration report (docs/results/gpu-calibration.md) is what
``benchmarks/gpu_calibration_report.py`` makes of the shipped measurements, so its numbers
cannot drift from the samples or from the cost model's fit."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_calibration_report", ROOT / "benchmarks" / "gpu_calibration_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_published_report_is_reproduced_from_the_shipped_samples() -> None:
    args = argparse.Namespace(
        samples=RESULTS / "gpu-calibration-h200.json",
        eager=RESULTS / "gpu-calibration-h200-eager.json",
        tflops_per_gpu=989.0, hbm_gbps_per_gpu=4800.0, hbm_gb_per_gpu=141.0)
    text = _script().report(args)
    assert text == (RESULTS / "gpu-calibration.md").read_text()
    # docs/cost-model.md quotes the fitted row: its a and mean error are this run's
    row = next(line for line in text.splitlines()
               if line.startswith("| efficiency and a fitted |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    page = (ROOT / "docs" / "cost-model.md").read_text()
    assert f"efficiency and a fitted: a = {cells[1]}," in page
    assert f"| {cells[5]} | {cells[6]} |" in page


def test_the_published_cost_section_loads_as_the_fitted_model() -> None:
    """The YAML the report prints for the gateway's ``conductor.cost`` validates, and a cost
    model built from it predicts what the fitted formula does (to its 6-digit rounding)."""
    import yaml
    from mooncake_conductor.cost import CostModel, CostModelConfig, fit_prefill_efficiency

    text = (RESULTS / "gpu-calibration.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = CostModelConfig.model_validate(yaml.safe_load(block)["cost"])
    script = _script()
    data = script.load(RESULTS / "gpu-calibration-h200.json")
    samples = script.prefill_samples(data)
    node = script.node_config(data, 989.0, 4800.0, 141.0)
    fit = fit_prefill_efficiency(samples, node)
    exact = CostModel(fit.applied_to(node))
    loaded = CostModel(cfg)
    for n, p, _ in samples:
        assert loaded.prefill_compute_time(n, p) == pytest.approx(
            exact.prefill_compute_time(n, p), rel=1e-4)
