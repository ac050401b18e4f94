"""The published GPU calibration report (docs/results/gpu-calibration.md) is what
``benchmarks/gpu_calibration_report.py`` makes of the shipped measurements, so its numbers
cannot drift from the samples or from the cost model's fit."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

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
    assert "| efficiency and a fitted | 3.5 |" in text  # the row docs/cost-model.md quotes
