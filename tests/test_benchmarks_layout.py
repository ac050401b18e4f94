"""Benchmarks stand on the packages: shared harness code lives in ``mooncake_testbed``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))
TEST_MODULES = {"tests", "worker_fixtures", "gateway_fixtures", "cluster_fixtures", "conftest"}


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_nothing_from_tests(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & TEST_MODULES
    assert "sys.path" not in path.read_text(), "benchmarks import installed packages only"


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 5
