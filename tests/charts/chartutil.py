"""Rendering the Helm chart in tests: the pinned helm binary, ``helm template`` as objects.

The pinned helm is built by ``mooncake-operator local-cluster build`` (tools/localcluster/
helm); a test that needs it and cannot find it fails with that one instruction: a chart
that is never rendered is not tested.
"""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mooncake-operator"
NAMESPACE = "mooncake-system"
RELEASE = "mc"
#: every optional part on
ALL_ON: dict[str, Any] = {
    "rbac": {"clusterWide": True},
    "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True}},
    "dashboard": {"enabled": True},
    "podDisruptionBudget": {"enabled": True},
    "gateway": {"auth": {"secretName": "api-keys", "adminSecretName": "admin-keys",
                         "requestsPerMinute": 600, "tokensPerMinute": 1000000}},
}


@functools.cache
def helm() -> Path:
    from mooncake_localcluster import components
    from mooncake_localcluster.settings import LocalClusterSettings

    settings = LocalClusterSettings()
    path = components.binary_path(settings, components.component("helm"),
                                  components.find_tools_dir(settings))
    if not path.is_file():
        pytest.fail(f"helm not found at {path}: run `mooncake-operator local-cluster build`",
                    pytrace=False)
    return path


def run_helm(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm()), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def template_args(values: dict[str, Any] | None, values_file: Path | None,
                  include_crds: bool = False) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if include_crds:
        args.append("--include-crds")
    if values_file is not None:
        args += ["--values", str(values_file)]
    return args


def template_text(values: dict[str, Any] | None = None, include_crds: bool = False) -> str:
    return _template_text(json.dumps(values or {}, sort_keys=True), include_crds)


@functools.cache
def _template_text(values_json: str, include_crds: bool) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(values_json)  # JSON is YAML
        f.flush()
        proc = run_helm(*template_args(None, Path(f.name), include_crds), check=True)
    return proc.stdout


def render(values: dict[str, Any] | None = None, include_crds: bool = False
           ) -> list[dict[str, Any]]:
    """The chart's objects for ``values`` (on top of values.yaml)."""
    return [d for d in yaml.safe_load_all(template_text(values, include_crds)) if d]


def find(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind
               and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, (kind, name_suffix, [o["metadata"]["name"] for o in matches])
    return matches[0]


def kinds(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objs)
