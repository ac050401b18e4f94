"""The Prometheus rules (charts/mooncake-operator/files/alerts.yaml): promtool accepts them
and their unit tests pass (tests/monitoring/alerts_test.yaml), every alert is shown firing
and silent there, every alert carries a severity and a runbook that is a section of
docs/troubleshooting.md, every metric they read is one the gateway or the operator
exports, and the chart ships them as a PrometheusRule."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_operator import metrics as operator_metrics
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from tests.charts.chartutil import CHART, NAMESPACE, find, render, run_helm
from tests.needs import missing

ROOT = Path(__file__).resolve().parents[2]
RULES = CHART / "files" / "alerts.yaml"
UNIT_TESTS = Path(__file__).resolve().parent / "alerts_test.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
RUNBOOK_BASE = ("https://github.com/mooncake-operator/mooncake-operator/blob/main/docs/"
                "troubleshooting.md")
SEVERITIES = {"critical", "warning"}
#: a label value no real series has: the children made to list the exported names
PROBE = "__alerts_test__"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing("prometheus", "promtool not found: apt-get install prometheus")
    return path


def _rules_file() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return data


def _alerts() -> list[dict[str, Any]]:
    return [r for g in _rules_file()["groups"] for r in g["rules"] if "alert" in r]


def _alert_names() -> list[str]:
    return [a["alert"] for a in _alerts()]


def _unit_tests() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))
    return data


def _alert_cases() -> list[dict[str, Any]]:
    return [case for group in _unit_tests()["tests"]
            for case in group.get("alert_rule_test") or []]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lowercased, punctuation dropped (hyphens
    and underscores kept), spaces turned into hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = re.match(r"#{1,6} (.+)$", line)
        if in_code or not match:
            continue
        base = github_anchor(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_github_anchor() -> None:
    assert github_anchor("MooncakeKVEventsStale") == "mooncakekveventsstale"
    assert github_anchor("Ready is False: reasons, and what to do") == \
        "ready-is-false-reasons-and-what-to-do"
    assert github_anchor("`kubectl apply` is refused") == "kubectl-apply-is-refused"
    assert "mooncake-store" in _anchors(TROUBLESHOOTING.read_text(encoding="utf-8"))


# -- promtool ----------------------------------------------------------------------------------
def test_promtool_check_rules() -> None:
    proc = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rules = sum(len(g["rules"]) for g in _rules_file()["groups"])
    assert f"SUCCESS: {rules} rules found" in proc.stdout, proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = subprocess.run([_promtool(), "test", "rules", str(UNIT_TESTS)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


# -- the unit tests cover every alert ----------------------------------------------------------
def test_unit_tests_read_the_chart_rules_every_minute() -> None:
    tests = _unit_tests()
    assert [(UNIT_TESTS.parent / f).resolve() for f in tests["rule_files"]] == [RULES]
    assert tests["evaluation_interval"] == "1m"
    assert {g["interval"] for g in tests["tests"]} == {"1m"}
    # promtool evaluates groups in random order unless every one is listed, recording first
    assert tests["group_eval_order"] == [g["name"] for g in _rules_file()["groups"]]


def test_every_alert_is_shown_firing_and_silent() -> None:
    names = set(_alert_names())
    cases = _alert_cases()
    unknown = sorted({c["alertname"] for c in cases} - names)
    assert not unknown, f"alerts_test.yaml tests alerts that alerts.yaml lacks: {unknown}"
    fires = {c["alertname"] for c in cases if c.get("exp_alerts")}
    silent = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    problems = [f"{n}: never shown firing" for n in sorted(names - fires)]
    problems += [f"{n}: never shown silent" for n in sorted(names - silent)]
    assert not problems, "alerts_test.yaml: " + "; ".join(problems)


def test_firing_cases_name_the_severity() -> None:
    """Each expected alert carries the alert's own severity (promtool compares all labels,
    so this only guards against a test written for another alert)."""
    severity = {a["alert"]: a["labels"]["severity"] for a in _alerts()}
    for case in _alert_cases():
        for exp in case.get("exp_alerts") or []:
            assert exp["exp_labels"]["severity"] == severity[case["alertname"]], case


# -- labels, annotations, runbooks -------------------------------------------------------------
def test_alert_names_are_unique() -> None:
    names = _alert_names()
    assert len(names) == len(set(names)), names


@pytest.mark.parametrize("name", _alert_names())
def test_alert_labels_and_annotations(name: str) -> None:
    (alert,) = [a for a in _alerts() if a["alert"] == name]
    assert alert["labels"]["severity"] in SEVERITIES, alert["labels"]
    annotations = alert["annotations"]
    for key in ("summary", "description", "runbook_url"):
        assert str(annotations.get(key, "")).strip(), f"{name}: no {key}"
    base, _, anchor = annotations["runbook_url"].partition("#")
    assert base == RUNBOOK_BASE, annotations["runbook_url"]
    assert anchor == name.lower(), annotations["runbook_url"]
    anchors = _anchors(TROUBLESHOOTING.read_text(encoding="utf-8"))
    assert anchor in anchors, f"docs/troubleshooting.md has no heading for #{anchor}"


def test_runbook_sections_are_under_alerts() -> None:
    text = TROUBLESHOOTING.read_text(encoding="utf-8")
    assert "\n## Alerts\n" in text
    section = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^### (\S+)$", section, re.M)
    assert headings == _alert_names(), "docs/troubleshooting.md#alerts: one ### per alert, " \
        "in the order of alerts.yaml"


# -- metric names ------------------------------------------------------------------------------
def _exposed(registry: CollectorRegistry, metrics: list[MetricWrapperBase]) -> set[str]:
    """The sample names ``registry`` exposes on /metrics with one child of each of
    ``metrics`` (their families hide until a child exists); the children are removed."""
    made: list[tuple[MetricWrapperBase, tuple[str, ...]]] = []
    try:
        for m in metrics:
            labelnames: tuple[str, ...] = m._labelnames
            if labelnames:
                values = (PROBE,) * len(labelnames)
                m.labels(*values)
                made.append((m, values))
        text = generate_latest(registry).decode()
    finally:
        for m, values in made:
            m.remove(*values)
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
            if line and not line.startswith("#")}


@functools.cache
def exported_names() -> frozenset[str]:
    gateway = GatewayMetrics()
    names = _exposed(gateway.registry,
                     [v for v in vars(gateway).values() if isinstance(v, MetricWrapperBase)])
    names |= _exposed(REGISTRY, [v for v in vars(operator_metrics).values()
                                 if isinstance(v, MetricWrapperBase)])
    return frozenset(names)


def _rule_metric_names() -> set[str]:
    exprs = [r["expr"] for g in _rules_file()["groups"] for r in g["rules"]]
    return {m for e in exprs
            for m in re.findall(r"\bmooncake_(?:gateway|operator)_[a-z0-9_]+\b", e)}


def test_exported_names_are_read_as_prometheus_sees_them() -> None:
    names = exported_names()
    assert {"mooncake_gateway_requests_total", "mooncake_gateway_routable_instances",
            "mooncake_gateway_time_to_first_token_seconds_bucket",
            "mooncake_operator_cluster_condition",
            "mooncake_operator_reconcile_failures_in_a_row"} <= names
    assert "mooncake_gateway_requests" not in names
    left = [s for fam in operator_metrics.CONDITION.collect() for s in fam.samples
            if PROBE in s.labels.values()]
    assert not left, "probe children left behind"


def test_rules_read_only_exported_metrics() -> None:
    used = _rule_metric_names()
    assert len(used) >= 9, used
    unknown = sorted(used - exported_names())
    assert not unknown, f"alerts.yaml reads metrics nothing exports: {unknown}"


def test_recording_rules_are_used() -> None:
    groups = _rules_file()["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    exprs = " ".join(a["expr"] for a in _alerts())
    assert recorded, "no recording rules"
    assert not [r for r in recorded if r not in exprs], recorded


# -- the chart ---------------------------------------------------------------------------------
def _prometheus_rule(values: dict[str, Any]) -> dict[str, Any]:
    return find(render({"metrics": {"prometheusRule": values,
                                    "serviceMonitor": {"enabled": True}}}), "PrometheusRule")


def test_chart_refuses_rules_without_the_service_monitor(tmp_path: Path) -> None:
    """The Down alerts would fire for good: helm names the value to turn on instead."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"metrics": {"prometheusRule": {"enabled": True}}}))
    proc = run_helm("template", "mc", str(CHART), "--values", str(values))
    assert proc.returncode != 0
    assert "needs metrics.serviceMonitor.enabled" in proc.stderr


def test_chart_has_no_prometheus_rule_by_default() -> None:
    assert [o for o in render() if o["kind"] == "PrometheusRule"] == []


def test_chart_renders_the_rules_as_a_prometheus_rule() -> None:
    rule = _prometheus_rule({"enabled": True, "labels": {"release": "kube-prometheus-stack"}})
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"]["groups"] == _rules_file()["groups"]


def test_chart_points_the_runbooks_at_runbook_base_url() -> None:
    base = "https://wiki.example.com/mooncake/runbooks"
    rule = _prometheus_rule({"enabled": True, "runbookBaseURL": base})
    expected = yaml.safe_load(RULES.read_text(encoding="utf-8").replace(RUNBOOK_BASE, base))
    assert rule["spec"]["groups"] == expected["groups"]
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"]
            for r in g["rules"] if "alert" in r]
    assert urls == [f"{base}#{n.lower()}" for n in _alert_names()]
