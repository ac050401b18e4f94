"""The chart's ServiceMonitor and PodMonitor as a plain Prometheus scrape configuration.

A pure translation (objects in, a ``prometheus.yml`` dict out) of what the Prometheus
Operator generates for those objects, for clusters that run Prometheus without the operator
and for the end-to-end tests, which scrape through exactly what the chart declares.

- A ``ServiceMonitor`` endpoint becomes one job that discovers with ``kubernetes_sd``:
  - ``role: endpoints`` (a real cluster; the Prometheus Operator's default): keep the
    endpoints of Services whose labels match the selector, on the named Service port;
  - ``role: pod`` (clusters without Endpoints objects, such as the embedded control plane,
    whose API server refuses loopback endpoint addresses): the Services are resolved here
    from the rendered objects, and the job keeps the pods their selectors pick, on the
    container port the Service port targets. Same targets, found one level lower.
  Targets are labelled as the Prometheus Operator labels them: ``job`` (the Service's
  name), ``namespace``, ``service``, ``pod``, ``container`` and ``endpoint`` (the port).
- A ``PodMonitor`` endpoint becomes one ``role: pod`` job named ``<namespace>/<name>``.
- ``path``, ``interval``, ``scrapeTimeout``, ``honorLabels`` and ``relabelings`` carry over.
- Discovery is Prometheus' own ``kubernetes_sd_configs``, or ``file_sd_configs`` fed by
  :mod:`mooncake_monitoring.kubesd` with the same meta labels (for a Prometheus built
  without Kubernetes discovery, such as Debian's); the relabelling is the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .rules import seconds

JsonDict = dict[str, Any]
Role = Literal["endpoints", "pod"]

#: pods in these phases are not scraped (as the Prometheus Operator does)
FINISHED_PHASES = "Failed|Succeeded"
_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def meta_label(kind: str, label: str, present: bool = False) -> str:
    """The discovery meta label of Kubernetes label ``label`` on a ``kind`` (pod, service)."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", label)
    return f"__meta_kubernetes_{kind}_label{'present' if present else ''}_{name}"


def selector_relabels(kind: str, selector: Mapping[str, Any]) -> list[JsonDict]:
    """``keep``/``drop`` rules equivalent to a label selector (matchLabels and
    matchExpressions with In, NotIn, Exists and DoesNotExist)."""
    out: list[JsonDict] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        out.append({"action": "keep", "source_labels": [meta_label(kind, key, True),
                                                        meta_label(kind, key)],
                    "regex": f"true;{re.escape(str(value))}"})
    for expr in selector.get("matchExpressions") or []:
        key, op = expr["key"], expr["operator"]
        present, label = meta_label(kind, key, True), meta_label(kind, key)
        values = "|".join(re.escape(str(v)) for v in expr.get("values") or [])
        if op == "In":
            out.append({"action": "keep", "source_labels": [present, label],
                        "regex": f"true;({values})"})
        elif op == "NotIn":
            out.append({"action": "drop", "source_labels": [present, label],
                        "regex": f"true;({values})"})
        elif op == "Exists":
            out.append({"action": "keep", "source_labels": [present], "regex": "true"})
        elif op == "DoesNotExist":
            out.append({"action": "drop", "source_labels": [present], "regex": "true"})
        else:
            raise ValueError(f"label selector operator {op!r} is not supported")
    return out


def _matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": not (key in labels and labels[key] in values),
              "Exists": key in labels, "DoesNotExist": key not in labels}.get(op)
        if ok is None:
            raise ValueError(f"label selector operator {op!r} is not supported")
        if not ok:
            return False
    return True


def _relabeling(r: Mapping[str, Any]) -> JsonDict:
    """A monitor's ``relabelings`` entry (camelCase) as a ``relabel_configs`` entry."""
    return {_CAMEL.sub("_", k).lower(): v for k, v in r.items()}


def _discovery(role: Role, namespaces: list[str] | None, kubeconfig: str | None,
               sd_file: str | None) -> tuple[JsonDict, list[JsonDict]]:
    """The job's discovery section, and the rules that stand in for what ``file_sd``
    cannot express (the namespace filter)."""
    if sd_file is not None:
        if role != "pod":
            raise ValueError("file discovery (mooncake_monitoring.kubesd) lists pods: "
                             "use role pod")
        keep = [{"action": "keep", "source_labels": ["__meta_kubernetes_namespace"],
                 "regex": "|".join(re.escape(n) for n in sorted(namespaces))}
                ] if namespaces else []
        return {"file_sd_configs": [{"files": [sd_file], "refresh_interval": "5s"}]}, keep
    sd: JsonDict = {"role": role}
    if namespaces:
        sd["namespaces"] = {"names": sorted(namespaces)}
    if kubeconfig:
        sd["kubeconfig_file"] = kubeconfig
    return {"kubernetes_sd_configs": [sd]}, []


def _namespaces(monitor: JsonDict) -> list[str] | None:
    ns_sel = monitor["spec"].get("namespaceSelector") or {}
    if ns_sel.get("any"):
        return None
    return list(ns_sel.get("matchNames") or [monitor["metadata"]["namespace"]])


@dataclass(frozen=True)
class Discovery:
    """How jobs find targets: Kubernetes discovery (``kubeconfig``: Prometheus outside the
    cluster) or, with ``sd_file``, the file :mod:`mooncake_monitoring.kubesd` writes."""

    kubeconfig: str | None = None
    sd_file: str | None = None


def _job(name: str, endpoint: Mapping[str, Any], role: Role, namespaces: list[str] | None,
         disc: Discovery | None, relabels: list[JsonDict]) -> JsonDict:
    disc = disc or Discovery()
    sd, extra = _discovery(role, namespaces, disc.kubeconfig, disc.sd_file)
    job: JsonDict = {"job_name": name, **sd,
                     "metrics_path": endpoint.get("path", "/metrics"),
                     "honor_labels": bool(endpoint.get("honorLabels", False))}
    if "interval" in endpoint:
        job["scrape_interval"] = endpoint["interval"]
    if "scrapeTimeout" in endpoint:
        job["scrape_timeout"] = endpoint["scrapeTimeout"]
    if "interval" in endpoint and "scrapeTimeout" in endpoint and \
            seconds(endpoint["scrapeTimeout"]) > seconds(endpoint["interval"]):
        raise ValueError(f"{name}: scrapeTimeout {endpoint['scrapeTimeout']} is longer than "
                         f"its interval {endpoint['interval']} (Prometheus refuses that)")
    job["relabel_configs"] = extra + relabels + [_relabeling(r)
                                                 for r in endpoint.get("relabelings") or []]
    return job


def _pod_labels(container: bool = True) -> list[JsonDict]:
    out = [{"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
            "regex": FINISHED_PHASES},
           {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
           {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    if container:
        out.append({"source_labels": ["__meta_kubernetes_pod_container_name"],
                    "target_label": "container"})
    return out


def _target_port_rule(target: Any) -> JsonDict:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"],
                "regex": str(target)}
    return {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": re.escape(str(target))}


def service_monitor_jobs(monitor: JsonDict, services: Iterable[JsonDict], role: Role,
                         disc: Discovery | None = None) -> list[JsonDict]:
    """The jobs of one ServiceMonitor (one per endpoint, and with ``role: pod`` one per
    endpoint and selected Service among ``services``)."""
    meta, spec = monitor["metadata"], monitor["spec"]
    namespaces = _namespaces(monitor)
    jobs: list[JsonDict] = []
    for i, ep in enumerate(spec.get("endpoints") or []):
        port = ep["port"]
        base = f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}"
        if role == "endpoints":
            rules = [
                *selector_relabels("service", spec.get("selector") or {}),
                {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                 "regex": re.escape(port)},
                *_pod_labels(),
                {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
                {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
                {"target_label": "endpoint", "replacement": port}]
            jobs.append(_job(base, ep, role, namespaces, disc, rules))
            continue
        for svc in services:
            s_meta, s_spec = svc["metadata"], svc.get("spec") or {}
            if namespaces is not None and s_meta.get("namespace") not in namespaces:
                continue
            if not _matches(spec.get("selector") or {}, s_meta.get("labels") or {}):
                continue
            ports = [p for p in s_spec.get("ports") or [] if p.get("name") == port]
            if not ports or not s_spec.get("selector"):
                continue
            target = ports[0].get("targetPort", ports[0]["port"])
            rules = [*selector_relabels("pod", {"matchLabels": s_spec["selector"]}),
                     _target_port_rule(target),
                     {"action": "keep", "source_labels": ["__meta_kubernetes_namespace"],
                      "regex": re.escape(s_meta["namespace"])},
                     *_pod_labels(),
                     {"target_label": "service", "replacement": s_meta["name"]},
                     {"target_label": "job", "replacement": s_meta["name"]},
                     {"target_label": "endpoint", "replacement": port}]
            jobs.append(_job(f"{base}/{s_meta['name']}", ep, role, namespaces, disc, rules))
    return jobs


def pod_monitor_jobs(monitor: JsonDict, disc: Discovery | None = None) -> list[JsonDict]:
    """The jobs of one PodMonitor (one per ``podMetricsEndpoints`` entry)."""
    meta, spec = monitor["metadata"], monitor["spec"]
    job_label = f"{meta['namespace']}/{meta['name']}"
    jobs = []
    for i, ep in enumerate(spec.get("podMetricsEndpoints") or []):
        port = ep["port"]
        rules = [*selector_relabels("pod", spec.get("selector") or {}),
                 _target_port_rule(port), *_pod_labels(),
                 {"target_label": "job", "replacement": job_label},
                 {"target_label": "endpoint", "replacement": port}]
        jobs.append(_job(f"podMonitor/{job_label}/{i}", ep, "pod", _namespaces(monitor),
                         disc, rules))
    return jobs


def scrape_config(objects: Iterable[JsonDict], role: Role = "endpoints",
                  disc: Discovery | None = None, scrape_interval: str = "30s",
                  evaluation_interval: str = "30s",
                  rule_files: list[str] | None = None) -> JsonDict:
    """A ``prometheus.yml`` for every ServiceMonitor and PodMonitor among ``objects`` (the
    chart's rendered manifests; its Services resolve ``role: pod`` ServiceMonitors)."""
    objs = [o for o in objects if isinstance(o, dict)]
    services = [o for o in objs if o.get("kind") == "Service"]
    jobs: list[JsonDict] = []
    for o in objs:
        if o.get("kind") == "ServiceMonitor":
            jobs += service_monitor_jobs(o, services, role, disc)
        elif o.get("kind") == "PodMonitor":
            jobs += pod_monitor_jobs(o, disc)
    if not jobs:
        raise ValueError("no ServiceMonitor or PodMonitor with endpoints among the objects: "
                         "render the chart with metrics.serviceMonitor.enabled=true")
    cfg: JsonDict = {"global": {"scrape_interval": scrape_interval,
                                "evaluation_interval": evaluation_interval},
                     "scrape_configs": jobs}
    if rule_files:
        cfg["rule_files"] = list(rule_files)
    return cfg
