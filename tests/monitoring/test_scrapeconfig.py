"""The chart's monitors as a Prometheus scrape config (mooncake_monitoring.scrapeconfig)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from mooncake_monitoring.kubesd import pod_target_groups
from mooncake_monitoring.scrapeconfig import (
    Discovery,
    meta_label,
    pod_monitor_jobs,
    scrape_config,
    selector_relabels,
    service_monitor_jobs,
)

from tests.needs import missing

from ..charts.chartutil import render

NS = "mooncake-system"  # chartutil's release namespace
SELECTOR = {"matchLabels": {"app.kubernetes.io/name": "x", "tier": "a.b"},
            "matchExpressions": [{"key": "mooncake.io/role", "operator": "In",
                                  "values": ["prefill", "decode"]},
                                 {"key": "skip", "operator": "DoesNotExist"},
                                 {"key": "zone", "operator": "NotIn", "values": ["z9"]},
                                 {"key": "gpu", "operator": "Exists"}]}


def _relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' relabelling of one target: keep, drop and replace (anchored regexes,
    ``;``-joined source labels), ``None`` when dropped."""
    out = dict(labels)
    for r in rules:
        value = ";".join(out.get(s, "") for s in r.get("source_labels", []))
        regex = re.compile(f"^(?:{r.get('regex', '(.*)')})$")
        action = r.get("action", "replace")
        if action == "keep" and not regex.match(value):
            return None
        if action == "drop" and regex.match(value):
            return None
        if action == "replace":
            m = regex.match(value)
            if m:
                out[r["target_label"]] = m.expand(
                    r.get("replacement", "$1").replace("$1", r"\1")
                    if m.groups() else r.get("replacement", "$1"))
    return out


def _pod(labels: dict[str, str], port: str = "metrics", phase: str = "Running"
         ) -> dict[str, str]:
    meta = {"__meta_kubernetes_namespace": NS, "__meta_kubernetes_pod_name": "p-0",
            "__meta_kubernetes_pod_phase": phase,
            "__meta_kubernetes_pod_container_name": "operator",
            "__meta_kubernetes_pod_container_port_name": port,
            "__meta_kubernetes_pod_container_port_number": "9095",
            "__address__": "127.1.0.5:9095"}
    for k, v in labels.items():
        meta[meta_label("pod", k)] = v
        meta[meta_label("pod", k, present=True)] = "true"
    return meta


@pytest.mark.parametrize("labels", [
    {"app.kubernetes.io/name": "x", "tier": "a.b", "mooncake.io/role": "decode", "gpu": "1"},
    {"app.kubernetes.io/name": "x", "tier": "a.b", "mooncake.io/role": "prefill", "gpu": ""},
    {"app.kubernetes.io/name": "x", "tier": "aXb", "mooncake.io/role": "decode", "gpu": "1"},
    {"app.kubernetes.io/name": "x", "tier": "a.b", "mooncake.io/role": "store", "gpu": "1"},
    {"app.kubernetes.io/name": "x", "tier": "a.b", "mooncake.io/role": "decode", "gpu": "1",
     "skip": "yes"},
    {"app.kubernetes.io/name": "x", "tier": "a.b", "mooncake.io/role": "decode", "gpu": "1",
     "zone": "z9"},
    {"app.kubernetes.io/name": "x", "tier": "a.b", "mooncake.io/role": "decode"},
    {"tier": "a.b", "mooncake.io/role": "decode", "gpu": "1"},
])
def test_selector_relabels_pick_what_the_selector_picks(labels: dict[str, str]) -> None:
    """The keep/drop rules keep a target exactly when Kubernetes' selector matches."""
    from mooncake_monitoring.scrapeconfig import _matches

    kept = _relabel(selector_relabels("pod", SELECTOR), _pod(labels)) is not None
    assert kept == _matches(SELECTOR, labels)


def test_unknown_selector_operator_is_refused() -> None:
    with pytest.raises(ValueError, match="Gt"):
        selector_relabels("pod", {"matchExpressions": [{"key": "a", "operator": "Gt"}]})


def _chart() -> list[dict[str, Any]]:
    return render({"metrics": {"serviceMonitor": {"enabled": True, "interval": "5s",
                                                  "scrapeTimeout": "5s"},
                               "podMonitor": {"enabled": True},
                               "prometheusRule": {"enabled": True}}})


def test_the_charts_monitors_find_the_operator_pod_by_its_service() -> None:
    objs = _chart()
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    services = [o for o in objs if o["kind"] == "Service"]
    (deploy,) = [o for o in objs if o["kind"] == "Deployment"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    jobs = service_monitor_jobs(sm, services, "pod")
    assert len(jobs) == 2  # operator metrics and the gateway's, through one Service
    by_endpoint = {}
    for job in jobs:
        assert job["scrape_interval"] == "5s"
        for port in ("metrics", "http"):  # the container ports the Service targets
            target = _relabel(job["relabel_configs"], _pod(pod_labels, port))
            if target is not None:
                by_endpoint[target["endpoint"]] = (port, target)
    assert set(by_endpoint) == {"metrics", "gateway-metrics"}
    assert by_endpoint["metrics"][0] == "metrics"
    assert by_endpoint["gateway-metrics"][0] == "http"
    _, gw = by_endpoint["gateway-metrics"]
    assert gw["mooncake_component"] == "gateway" and gw["namespace"] == NS
    assert gw["job"] == gw["service"] and gw["service"].endswith("-metrics")
    assert by_endpoint["metrics"][1]["mooncake_component"] == "operator"
    # another pod, a finished pod: not scraped
    assert all(_relabel(j["relabel_configs"], _pod({"app": "other"})) is None for j in jobs)
    assert all(_relabel(j["relabel_configs"], _pod(pod_labels, phase="Succeeded")) is None
               for j in jobs)


def test_the_pod_monitor_keeps_engine_pods_only() -> None:
    (pm,) = [o for o in _chart() if o["kind"] == "PodMonitor"]
    jobs = pod_monitor_jobs(pm)
    assert [next(r["replacement"] for r in j["relabel_configs"]
                 if r.get("target_label") == "endpoint") for j in jobs] == ["http", "engine-http"]
    engine = {"app.kubernetes.io/managed-by": "mooncake-operator", "mooncake.io/role": "decode"}
    store = {**engine, "mooncake.io/role": "store-node"}
    t = _relabel(jobs[0]["relabel_configs"], _pod(engine, "http"))
    assert t is not None and t["mooncake_component"] == "engine" and t["endpoint"] == "http"
    assert _relabel(jobs[0]["relabel_configs"], _pod(store, "http")) is None
    assert _relabel(jobs[0]["relabel_configs"], _pod(engine, "kv-events")) is None


def test_endpoints_role_keeps_the_named_service_port() -> None:
    objs = _chart()
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    jobs = service_monitor_jobs(sm, [], "endpoints")
    svc = {meta_label("service", k): v for k, v in
           next(o for o in objs if o["kind"] == "Service" and
                o["metadata"]["name"].endswith("-metrics"))["metadata"]["labels"].items()}
    svc |= {meta_label("service", k, True): "true" for k in list(svc)}
    present = {k.replace("_label_", "_labelpresent_"): "true" for k in svc
               if "_label_" in k}
    base = {**_pod({}), **svc, **present, "__meta_kubernetes_service_name": "mc-metrics"}
    hits = [_relabel(j["relabel_configs"],
                     {**base, "__meta_kubernetes_endpoint_port_name": "gateway-metrics"})
            for j in jobs]
    kept = [h for h in hits if h is not None]
    assert len(kept) == 1 and kept[0]["job"] == "mc-metrics"
    assert kept[0]["endpoint"] == "gateway-metrics"


def test_a_timeout_longer_than_the_interval_is_refused() -> None:
    """Prometheus refuses to load such a job: say which monitor, not a broken config."""
    objs = render({"metrics": {"serviceMonitor": {"enabled": True, "interval": "5s"}}})
    with pytest.raises(ValueError, match=r"scrapeTimeout 10s.*interval 5s"):
        scrape_config(objs)


def test_without_monitors_it_says_what_to_turn_on() -> None:
    with pytest.raises(ValueError, match=r"serviceMonitor\.enabled"):
        scrape_config(render({}))


def test_prometheus_accepts_the_generated_config(tmp_path: Path) -> None:
    """Debian's promtool (2.42) knows no kubernetes_sd_configs: it checks the file-discovery
    variant, whose jobs differ only in the discovery section and a namespace rule."""
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("prometheus", "promtool not found: apt-get install prometheus")
    sd = str(tmp_path / "pods.json")
    cfg = scrape_config(_chart(), role="pod", disc=Discovery(sd_file=sd))
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    k8s = scrape_config(_chart(), role="pod", disc=Discovery(kubeconfig="/k"))
    for f, k in zip(cfg["scrape_configs"], k8s["scrape_configs"], strict=True):
        assert k["kubernetes_sd_configs"] == [{"role": "pod",
                                               "namespaces": {"names": [NS]},
                                               "kubeconfig_file": "/k"}]
        assert f["relabel_configs"][1:] == k["relabel_configs"]
        assert f["relabel_configs"][0] == {"action": "keep", "regex": re.escape(NS),
                                           "source_labels": ["__meta_kubernetes_namespace"]}
    with pytest.raises(ValueError, match="role pod"):
        scrape_config(_chart(), role="endpoints", disc=Discovery(sd_file=sd))


def test_file_discovery_labels_pods_as_kubernetes_sd_does() -> None:
    pod = {"metadata": {"name": "p", "namespace": NS, "uid": "u",
                        "labels": {"mooncake.io/role": "decode",
                                   "app.kubernetes.io/managed-by": "mooncake-operator"}},
           "spec": {"nodeName": "n", "containers": [
               {"name": "engine", "ports": [{"name": "http", "containerPort": 8000},
                                            {"name": "kv-events", "containerPort": 5557}]},
               {"name": "sidecar"}]},
           "status": {"podIP": "127.1.0.9", "phase": "Running",
                      "conditions": [{"type": "Ready", "status": "True"}]}}
    groups = pod_target_groups([pod, {**pod, "status": {"phase": "Pending"}}])
    assert [g["targets"] for g in groups] == [["127.1.0.9:8000"], ["127.1.0.9:5557"]]
    labels = groups[0]["labels"]
    assert labels["__meta_kubernetes_pod_label_mooncake_io_role"] == "decode"
    assert labels["__meta_kubernetes_pod_labelpresent_mooncake_io_role"] == "true"
    assert labels["__meta_kubernetes_pod_container_port_name"] == "http"
    assert labels["__meta_kubernetes_pod_ready"] == "true"
    (pm,) = [o for o in _chart() if o["kind"] == "PodMonitor"]
    http_job = pod_monitor_jobs(pm)[0]
    kept = [_relabel(http_job["relabel_configs"], g["labels"]) for g in groups]
    assert [k is not None for k in kept] == [True, False]
