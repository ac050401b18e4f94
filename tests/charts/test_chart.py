"""The Helm chart without a cluster: lint, renders (default and every option on), the
values schema, the CRD copy, the containers' command lines against the real CLI, probes
against the real endpoints, the dashboard against the real metric names, NOTES.txt."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from mooncake_cli.main import build_parser
from mooncake_gateway.cli import gateway_settings
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_gateway.server import Gateway
from mooncake_gateway.settings import GatewaySettings, KubernetesModels
from mooncake_operator import __version__, crd
from mooncake_operator import metrics as operator_metrics
from mooncake_operator.settings import OperatorSettings
from prometheus_client import Counter, Gauge, Histogram

from .chartutil import ALL_ON, CHART, NAMESPACE, RELEASE, ROOT, find, kinds, render, run_helm

FULLNAME = f"{RELEASE}-mooncake-operator"
DOCS = ROOT / "docs" / "helm.md"


def _deployment(values: dict[str, Any] | None = None) -> dict[str, Any]:
    return find(render(values), "Deployment")


def _container(dep: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    out: dict[str, Any] = c
    return out


def dep_labels(dep: dict[str, Any]) -> dict[str, str]:
    """The labels of the Deployment's pods."""
    labels: dict[str, str] = dep["spec"]["template"]["metadata"]["labels"]
    return labels


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


# -- lint, metadata, CRD ------------------------------------------------------------------------
@pytest.mark.parametrize("values", [None, ALL_ON], ids=["default", "all-on"])
def test_helm_lint_strict(values: dict[str, Any] | None, tmp_path: Path) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values:
        f = tmp_path / "values.yaml"
        f.write_text(json.dumps(values))
        args += ["--values", str(f)]
    proc = run_helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    dep = _deployment()
    assert _container(dep, "operator")["image"] == \
        f"ghcr.io/mooncake-operator/operator:{__version__}"
    assert _env(_container(dep, "operator"))["MOONCAKE_OPERATOR_IMAGE"] == \
        f"ghcr.io/mooncake-operator/worker:{__version__}"


def test_chart_crd_is_the_generated_one() -> None:
    """One source: the chart's crds/ copy, the top-level crds/ and the models agree
    (`mooncake-operator operator crd --write` writes both)."""
    chart_copy = (CHART / "crds" / crd.CRD_FILE).read_text(encoding="utf-8")
    top = (ROOT / crd.CRD_DIR / crd.CRD_FILE).read_text(encoding="utf-8")
    assert chart_copy == top, "charts/mooncake-operator/crds/ drifted: run " \
        "`mooncake-operator operator crd --write`"
    assert chart_copy == crd.render(), "run `mooncake-operator operator crd --write`"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [crd.CRD_FILE]
    assert crd.main(["--check"]) == 0


def test_crd_is_not_templated() -> None:
    """Helm installs crds/ before the templates and never templates or deletes them."""
    assert not [o for o in render(ALL_ON) if o["kind"] == "CustomResourceDefinition"]
    with_crds = render(include_crds=True)
    assert find(with_crds, "CustomResourceDefinition")["metadata"]["name"] == crd.CRD_NAME


# -- what renders -------------------------------------------------------------------------------
def test_default_render() -> None:
    objs = render()
    assert kinds(objs) == ["ClusterRole", "ClusterRoleBinding", "Deployment",
                           "PodDisruptionBudget", "Role", "RoleBinding", "Service", "Service",
                           "ServiceAccount"]
    for o in objs:
        if o["kind"].startswith("Cluster"):  # the nodes reader (rbac.readNodes)
            assert "namespace" not in o["metadata"] and o["metadata"]["name"].endswith(
                "-nodes"), o["metadata"]
        else:
            assert o["metadata"]["namespace"] == NAMESPACE, o["kind"]
        assert o["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    dep = find(objs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    # the new pod first: the gateway Service never empties during an upgrade
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": 1, "maxUnavailable": 0}}
    assert _deployment({"replicas": 3})["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["operator", "gateway"]
    assert pod["serviceAccountName"] == find(objs, "ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True


def test_all_options_render() -> None:
    objs = render(ALL_ON)
    assert kinds(objs) == ["ClusterRole", "ClusterRole", "ClusterRoleBinding",
                           "ClusterRoleBinding", "ConfigMap", "Deployment",
                           "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "Service",
                           "Service", "ServiceAccount", "ServiceMonitor"]
    for o in objs:
        if o["kind"].startswith("Cluster"):
            assert "namespace" not in o["metadata"]
        else:
            assert o["metadata"]["namespace"] == NAMESPACE, o["kind"]


def _cli(args: list[str]) -> Any:
    return build_parser().parse_args(args)


def test_operator_container_namespaced(monkeypatch: pytest.MonkeyPatch) -> None:
    c = _container(_deployment(), "operator")
    assert "command" not in c  # the image's ENTRYPOINT is mooncake-operator
    args = _cli(c["args"])
    assert (args.command, args.operator_command) == ("operator", "run")
    assert args.namespace == [NAMESPACE]
    assert not args.gateway and not args.install_crd
    env = _env(c)
    assert env["MOONCAKE_OPERATOR_GATEWAY_URL"] == "http://127.0.0.1:8080"
    assert env["MOONCAKE_OPERATOR_GATEWAY_PUBLIC_URL"] == \
        f"http://{FULLNAME}-gateway.{NAMESPACE}.svc:8080"
    # every variable is a real setting and the values parse
    fields = {k.removeprefix("MOONCAKE_OPERATOR_").lower(): v for k, v in env.items()
              if k.startswith("MOONCAKE_OPERATOR_")}
    assert set(fields) <= set(OperatorSettings.model_fields), set(fields)
    for k, v in env.items():  # read as the process reads them: from its environment
        if k.startswith("MOONCAKE_OPERATOR_"):
            monkeypatch.setenv(k, v)
    settings = OperatorSettings()
    assert settings.gateway_pod_labels == dep_labels(_deployment())
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", 9095)
    # kopf's liveness endpoint is the port the probes use
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.liveness == f"http://0.0.0.0:{ports['health']}/healthz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert ports["metrics"] == settings.metrics_port


def test_gateway_container_namespaced() -> None:
    c = _container(_deployment(), "gateway")
    args = _cli(c["args"])
    assert args.command == "gateway"
    gs = gateway_settings(args)
    assert gs.kubernetes_models is not None
    assert gs.kubernetes_models.namespace == NAMESPACE
    assert (gs.host, gs.port) == ("0.0.0.0", 8080)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8080}
    assert _env(c)["NUMBA_CACHE_DIR"].startswith("/tmp/")
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    app = Gateway(GatewaySettings(kubernetes_models=KubernetesModels(namespace="x")),
                  kube=object()).app  # type: ignore[arg-type]
    routes = {r.canonical for r in app.router.resources()}
    assert {"/health", "/ready", "/metrics"} <= routes


def test_api_key_secrets_reach_the_gateway_and_the_operator_as_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``gateway.auth`` set, the Secrets are mounted read-only where the environment
    says, and the environment parses as the real settings of both processes."""
    dep = _deployment(ALL_ON)
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["gateway-keys"]["secret"]["secretName"] == "api-keys"
    assert volumes["gateway-admin-keys"]["secret"]["secretName"] == "admin-keys"
    gw, op = _container(dep, "gateway"), _container(dep, "operator")
    mounts = {m["name"]: m for m in gw["volumeMounts"]}
    env = _env(gw)
    for name, var in (("gateway-keys", "KEYS_DIR"), ("gateway-admin-keys", "ADMIN_KEYS_DIR")):
        assert mounts[name]["readOnly"] is True
        assert env[f"MOONCAKE_GATEWAY_AUTH__{var}"] == mounts[name]["mountPath"]
    for k, v in env.items():
        if k.startswith("MOONCAKE_GATEWAY_"):
            monkeypatch.setenv(k, v)
    auth = GatewaySettings().auth
    assert auth.enabled and (auth.requests_per_minute, auth.tokens_per_minute) == (600, 1e6)
    (op_mount,) = [m for m in op["volumeMounts"] if m["name"] == "gateway-admin-keys"]
    for k, v in _env(op).items():
        if k.startswith("MOONCAKE_OPERATOR_"):
            monkeypatch.setenv(k, v)
    settings = OperatorSettings()
    assert str(settings.gateway_admin_keys_dir) == op_mount["mountPath"] \
        == str(auth.admin_keys_dir)
    # off by default: nothing mounted, no key directory set
    plain = _deployment()
    assert [v["name"] for v in plain["spec"]["template"]["spec"]["volumes"]] == ["tmp"]
    assert not any(k.endswith("KEYS_DIR") for c in ("gateway", "operator")
                   for k in _env(_container(plain, c)))


def test_cluster_wide_watches_every_namespace() -> None:
    dep = _deployment({"rbac": {"clusterWide": True}})
    assert _cli(_container(dep, "operator")["args"]).namespace is None
    gs = gateway_settings(_cli(_container(dep, "gateway")["args"]))
    assert gs.kubernetes_models is not None and gs.kubernetes_models.namespace is None


def test_bind_address_pod_ip() -> None:
    """Another bind address (e.g. the pod IP) is where the operator reads the gateway."""
    dep = _deployment({"gateway": {"bindAddress": "$(POD_IP)"},
                       "operator": {"bindAddress": "$(POD_IP)"}})
    op = _container(dep, "operator")
    assert _env(op)["MOONCAKE_OPERATOR_GATEWAY_URL"] == "http://$(POD_IP):8080"
    assert _cli(op["args"]).liveness == "http://$(POD_IP):8081/healthz"
    assert op["env"][0]["name"] == "POD_IP"  # defined before the variables that use it


def test_resources_and_probes_everywhere() -> None:
    for c in _deployment()["spec"]["template"]["spec"]["containers"]:
        res = c["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]), c["name"]
        assert "memory" in res["limits"], c["name"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert "httpGet" in c[probe], (c["name"], probe)
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_services_select_the_pod() -> None:
    objs = render(ALL_ON)
    dep = find(objs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    gw = find(objs, "Service", "-gateway")
    assert gw["metadata"]["name"] == f"{FULLNAME}-gateway"
    assert gw["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http",
                                    "protocol": "TCP"}]
    metrics = find(objs, "Service", "-metrics")
    assert {p["name"]: p["targetPort"] for p in metrics["spec"]["ports"]} == {
        "metrics": "metrics", "gateway-metrics": "http"}
    for svc in (gw, metrics):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
    sm = find(objs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= gw["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics", "gateway-metrics"]
    pdb = find(objs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_two_replicas_by_default_spread_and_guarded_by_a_pdb() -> None:
    """The default is two operator pods, preferably on two nodes, and a drain may evict
    only one of them at a time."""
    objs = render()
    pod = find(objs, "Deployment")["spec"]["template"]
    [spread] = pod["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # one node still schedules both
    assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert find(objs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1


@pytest.mark.parametrize("values", [
    {"replicas": 1},
    {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {
            "app.kubernetes.io/name": "mooncake-operator"}}}]}}},
    {"spreadAcrossNodes": False},
])
def test_no_spread_for_one_replica_or_an_own_affinity(values: dict[str, Any]) -> None:
    pod = _deployment(values)["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in pod
    assert ("affinity" in pod) == ("affinity" in values)


def test_one_replica_gets_no_pdb_that_would_stall_drains() -> None:
    assert "PodDisruptionBudget" not in kinds(render({"replicas": 1}))
    assert "PodDisruptionBudget" not in kinds(render({"podDisruptionBudget": {
        "enabled": False}}))


def test_pdb_max_unavailable() -> None:
    pdb = find(render({"podDisruptionBudget": {"enabled": True, "maxUnavailable": 1}}),
               "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}


# -- values.schema.json ---------------------------------------------------------------------
@pytest.mark.parametrize(("values", "field"), [
    ({"gateway": {"port": 0}}, "/gateway/port"),
    ({"gateway": {"port": "8080"}}, "/gateway/port"),
    ({"rbac": {"clusterWide": "yes"}}, "/rbac/clusterWide"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    ({"operator": {"bogus": 1}}, "bogus"),
    ({"replicas": 0}, "/replicas"),
    ({"worker": {"image": {"repository": ""}}}, "/worker/image/repository"),
    # limits are required (null removes the default)
    ({"gateway": {"resources": {"limits": {"memory": None}}}}, "/gateway/resources/limits"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}},
     "/metrics/serviceMonitor/interval"),
    ({"gateway": {"auth": {"reloadSeconds": 0}}}, "/gateway/auth/reloadSeconds"),
    ({"gateway": {"auth": {"secretName": "Not_A_Name"}}}, "/gateway/auth/secretName"),
    ({"gateway": {"auth": {"apiKey": "sk-1"}}}, "apiKey"),  # never a key in values
])
def test_schema_rejects(values: dict[str, Any], field: str, tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(json.dumps(values))
    proc = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--values", str(f))
    assert proc.returncode != 0, f"accepted {values}"
    assert field in proc.stderr, proc.stderr


def test_schema_is_strict_on_our_objects() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict[str, Any], path: str) -> list[str]:
        out = []
        if node.get("type") == "object" and "properties" in node \
                and node.get("additionalProperties") is not False:
            out.append(path or "/")
        for name, sub in (node.get("properties") or {}).items():
            out += walk(sub, f"{path}/{name}")
        return out

    assert walk(schema, "") == []
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])


# -- dashboard --------------------------------------------------------------------------------
def _exported_names() -> set[str]:
    """Every series name the gateway and the operator export."""
    out: set[str] = set()
    families: list[Any] = list(GatewayMetrics().registry.collect())
    families += [m for v in vars(operator_metrics).values()
                 if isinstance(v, Counter | Gauge | Histogram) for m in v.collect()]
    for fam in families:
        if fam.type == "counter":
            out.add(f"{fam.name}_total")
        elif fam.type == "histogram":
            out |= {f"{fam.name}_bucket", f"{fam.name}_sum", f"{fam.name}_count"}
        else:
            out.add(fam.name)
    return out


def test_dashboard_uses_real_metric_names() -> None:
    cm = find(render({"dashboard": {"enabled": True}}), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = cm["data"].values()
    dash = json.loads(text)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bmooncake_[a-z_]+\b", e)}
    exported = _exported_names()
    assert used - exported == set(), f"not exported: {sorted(used - exported)}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("first token", "between tokens", "hit ratio", "rejections", "per pod",
                  "hot prefixes"):
        assert topic in titles, topic
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


# -- NOTES.txt --------------------------------------------------------------------------------
def test_notes_tell_how_to_reach_the_gateway(tmp_path: Path) -> None:
    """`helm template` does not render NOTES.txt: render it as a ConfigMap of a copy."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "notes" -}}\n' + notes + '\n{{- end -}}\n')
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n"
        '    {{- include "notes" . | nindent 4 }}\n')
    for values, ns_note in ((None, f"in namespace {NAMESPACE} only"),
                            ({"rbac": {"clusterWide": True}}, "in every namespace")):
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE,
                "--show-only", "templates/notes.yaml"]
        if values:
            f = tmp_path / "v.yaml"
            f.write_text(json.dumps(values))
            args += ["--values", str(f)]
        proc = run_helm(*args, check=True)
        text = yaml.safe_load(proc.stdout)["data"]["notes"]
        assert ns_note in " ".join(text.split())
        assert (f"kubectl -n {NAMESPACE} port-forward svc/{FULLNAME}-gateway 8080:8080"
                in text)
        assert f"http://{FULLNAME}-gateway.{NAMESPACE}.svc:8080" in text
        assert f"kubectl -n {NAMESPACE} apply -f examples/clusters/simulated.yaml" in text
        assert (ROOT / "examples" / "clusters" / "simulated.yaml").is_file()
        assert "kubectl apply --server-side -f" in text


# -- docs -------------------------------------------------------------------------------------
def _leaves(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path
                                                                 else k)]
    return [path]


#: top-level values that are Kubernetes objects: documented as a whole
OPEN_OBJECTS = ("podSecurityContext", "securityContext")


def test_every_value_is_documented() -> None:
    """docs/helm.md's values table names every value of values.yaml (or the object it is
    part of: ``operator.resources`` covers its requests and limits)."""
    doc = DOCS.read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def documented(leaf: str) -> bool:
        parts = leaf.split(".")
        prefixes = {".".join(parts[:i]) for i in range(2, len(parts) + 1)} | {leaf}
        if parts[0] in OPEN_OBJECTS:
            prefixes.add(parts[0])
        return any(f"`{p}`" in doc for p in prefixes)

    missing = [leaf for leaf in _leaves(values) if not documented(leaf)]
    assert missing == [], f"not in docs/helm.md: {missing}"
