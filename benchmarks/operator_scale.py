"""The operator at scale on the embedded cluster: apply a MooncakeCluster, time it to Ready,
and account the operator's CPU, memory, API writes and reconciles on the way.

    python benchmarks/operator_scale.py [--runs N] [--json out.json] [--sizes 4,32]
        [--skip-real] [--steady-s 60]

Two modes, each with its own ``mooncake-operator operator run`` process:

- ``real``: 4 prefill + 4 decode simulated worker pods (the project's image, so the pod
  runner starts each as a local process), 1 GPU per replica, the example's Mooncake Store
  (master Deployment + store-node DaemonSet), the gateway beside the operator
  (``--gateway``). apply -> Ready covers scheduling, process start, the store and the
  gateway's registration of every pod.
- ``control-plane``: engine pods of an image the pod runner does not run
  (``registry.example/engine:1``), so kwok fakes them Running and Ready at once; store and
  gateway off. What is left is the operator's own work (creates, status, events), for every
  ``--sizes`` N (N prefill + N decode pods). After each run of the largest size the
  cluster is left alone for ``--steady-s`` seconds: what does the operator spend idle?

Every run is a fresh MooncakeCluster object (a new name); the previous one is deleted and
its pods waited out first. The benchmark starts and stops its own local cluster
(``--cluster-name``, default ``opbench``) and purges its state at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "clusters" / "simulated.yaml"
CRD_FILE = ROOT / "crds" / "mooncake.io_mooncakeclusters.yaml"
GROUP_PATH = "/apis/mooncake.io/v1alpha1"
NAMESPACE = "opbench"
FAKE_IMAGE = "registry.example/engine:1"
HOST = "127.0.0.1"
POLL_S = 0.2
CLK_TCK = os.sysconf("SC_CLK_TCK")
ENGINE_ROLES = ("prefill", "decode")
REAL = "real"
CONTROL_PLANE = "control-plane"
MODE_TITLE = {REAL: "real engines", CONTROL_PLANE: "control plane only"}
JsonDict = dict[str, Any]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- /proc ----------------------------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (all its threads) so far; 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def status_kib(pid: int | None, key: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 when gone."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_until(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, RuntimeError):
            if cond():
                return
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


# -- Prometheus -----------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    """The operator's counters we diff: ``writes:<verb>/<kind>``, ``reads:<verb>/<kind>``
    and ``reconciles:<outcome>``."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels_text, _, value = rest.rpartition("}")
        labels = dict(part.split("=", 1) for part in labels_text.split(",") if "=" in part)
        labels = {k.strip(): v.strip().strip('"') for k, v in labels.items()}
        if name == "mooncake_operator_api_writes_total":
            out[f"writes:{labels.get('verb')}/{labels.get('kind')}"] = float(value)
        elif name == "mooncake_operator_api_reads_total":
            out[f"reads:{labels.get('verb')}/{labels.get('kind')}"] = float(value)
        elif name == "mooncake_operator_reconciles_total":
            out[f"reconciles:{labels.get('outcome')}"] = float(value)
    return out


def diff(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, int]:
    keys = {k for k in after if k.startswith(prefix)}
    out = {k[len(prefix):]: round(after[k] - before.get(k, 0.0)) for k in sorted(keys)}
    return {k: v for k, v in out.items() if v}


# -- the operator process -------------------------------------------------------------------------
@dataclass
class OperatorProc:
    proc: subprocess.Popen[bytes]
    metrics_url: str
    gateway_url: str | None
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def gateway_pid(self) -> int | None:
        if self.gateway_url is None:
            return None
        for pid in child_pids(self.pid):
            if " gateway " in cmdline(pid):
                return pid
        return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextlib.contextmanager
def run_operator(kubeconfig: Path, workdir: Path, gateway: bool) -> Iterator[OperatorProc]:
    metrics_port = free_port()
    gw_port = free_port()  # unused without --gateway: the operator then reads nothing there
    gw_url = f"http://{HOST}:{gw_port}"
    env = dict(os.environ, KUBECONFIG=str(kubeconfig),
               MOONCAKE_OPERATOR_METRICS_PORT=str(metrics_port),
               MOONCAKE_OPERATOR_GATEWAY_URL=gw_url)
    # The CRD is installed (and served) before the operator starts: see install_crd.
    argv = [sys.executable, "-m", "mooncake_cli", "operator", "run", "--log-level", "INFO"]
    if gateway:
        argv += ["--gateway", "--gateway-port", str(gw_port)]
    log_path = workdir / f"operator-{'gateway' if gateway else 'alone'}.log"
    with log_path.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    op = OperatorProc(proc, f"http://{HOST}:{metrics_port}/metrics",
                      gw_url if gateway else None, log_path)
    try:
        started = time.monotonic()

        def up() -> bool:
            if not op.alive():
                raise SystemExit(f"the operator exited ({proc.returncode}):\n{op.log_tail()}")
            scrape(op.metrics_url)
            if op.gateway_url is not None:
                with urllib.request.urlopen(f"{op.gateway_url}/health", timeout=5):
                    pass
            return True

        wait_until(up, 180, "the operator's metrics endpoint" + (" and the gateway"
                                                                  if gateway else ""))
        settle(op)
        if "Unresolved resources cannot be served" in op.log_tail(200):
            raise SystemExit(f"the operator does not watch MooncakeClusters (kopf did not find "
                             f"the CRD); see {log_path}")
        log(f"operator pid {op.pid} up in {time.monotonic() - started:.1f}s"
            + (f", gateway pid {op.gateway_pid()} at {op.gateway_url}" if gateway else "")
            + f"; log {log_path}")
        yield op
    finally:
        op.stop()


def settle(op: OperatorProc, quiet_cpu_s: float = 0.1, window_s: float = 2.0,
           timeout_s: float = 60.0) -> None:
    """Wait until the operator is idle (kopf's watches are up, start-up imports done):
    less than ``quiet_cpu_s`` of CPU in ``window_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = cpu_seconds(op.pid) + cpu_seconds(op.gateway_pid())
        time.sleep(window_s)
        if cpu_seconds(op.pid) + cpu_seconds(op.gateway_pid()) - before < quiet_cpu_s:
            return


# -- the API --------------------------------------------------------------------------------------
def cluster_path(name: str | None = None) -> str:
    base = f"{GROUP_PATH}/namespaces/{NAMESPACE}/mooncakeclusters"
    return f"{base}/{name}" if name else base


def pods_path() -> str:
    return f"/api/v1/namespaces/{NAMESPACE}/pods"


def engine_selector(name: str) -> str:
    return f"mooncake.io/cluster={name},mooncake.io/role in ({','.join(ENGINE_ROLES)})"


def ready_condition(obj: JsonDict) -> tuple[bool, str]:
    """(Ready for the current generation, the Ready reason)."""
    st = obj.get("status") or {}
    for cond in st.get("conditions") or []:
        if cond.get("type") == "Ready":
            current = st.get("observedGeneration") == obj["metadata"].get("generation")
            return current and cond.get("status") == "True", str(cond.get("reason", ""))
    return False, "NoStatus"


def pod_ready(pod: JsonDict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class PodWatch(threading.Thread):
    """Watches the engine pods of one cluster: when each was first seen, and first Ready."""

    def __init__(self, http: Any, name: str, timeout_s: int) -> None:
        super().__init__(daemon=True, name=f"watch-{name}")
        self.http = http
        self.selector = engine_selector(name)
        self.timeout_s = timeout_s
        self.t0 = time.monotonic()
        self.created: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.done = threading.Event()
        self.error: str | None = None
        listing = http.get(f"{pods_path()}?labelSelector="
                           f"{urllib.parse.quote(self.selector)}")
        self.resource_version = str(listing["metadata"].get("resourceVersion", ""))

    def run(self) -> None:
        params = {"labelSelector": self.selector, "resourceVersion": self.resource_version}
        try:
            for event in self.http.watch(pods_path(), params, self.timeout_s):
                if self.done.is_set():
                    return
                pod = event.get("object") or {}
                name = (pod.get("metadata") or {}).get("name")
                if not name or event.get("type") not in ("ADDED", "MODIFIED"):
                    continue
                now = time.monotonic() - self.t0
                self.created.setdefault(name, now)
                if pod_ready(pod):
                    self.ready.setdefault(name, now)
        except Exception as exc:  # a broken watch costs the two pod columns, not the run
            self.error = f"{type(exc).__name__}: {exc}"

    def nth(self, times: dict[str, float], n: int) -> float | None:
        values = sorted(times.values())
        return values[n - 1] if len(values) >= n else None


def cluster_events(http: Any, name: str) -> dict[str, int]:
    """Event objects about the MooncakeCluster, by reason (each one was a POST)."""
    q = urllib.parse.quote(f"involvedObject.name={name},involvedObject.kind=MooncakeCluster")
    items = http.get(f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector={q}")["items"]
    out: dict[str, int] = {}
    for ev in items:
        out[str(ev.get("reason"))] = out.get(str(ev.get("reason")), 0) + 1
    return out


def install_crd(http: Any) -> None:
    """Server-side apply ``crds/``'s CRD and wait until discovery serves it.

    Not ``operator run --install-crd``: that applies the CRD and starts kopf at once, and
    kopf's start-up scan of ``/apis`` can run before the new group is served; kopf then logs
    "Unresolved resources cannot be served" and, as it ignores the CRD watch's initial
    listing, never watches MooncakeClusters (seen here on a fresh cluster)."""
    crd: JsonDict = yaml.safe_load(CRD_FILE.read_text())
    name = crd["metadata"]["name"]
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    version = next(v["name"] for v in crd["spec"]["versions"] if v.get("served", True))
    http.request("PATCH", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
                 "?fieldManager=opbench&force=true", crd, "application/apply-patch+yaml")

    def served() -> bool:
        obj = http.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        established = any(c.get("type") == "Established" and c.get("status") == "True"
                          for c in (obj.get("status") or {}).get("conditions") or [])
        listing = http.get(f"/apis/{group}/{version}")
        return established and any(r.get("name") == plural for r in listing["resources"])

    wait_until(served, 60, f"the CRD {name} to be served", every=0.2)


def manifest(mode: str, name: str, size: int) -> JsonDict:
    obj: JsonDict = yaml.safe_load(EXAMPLE.read_text())
    obj["metadata"] = {"name": name, "namespace": NAMESPACE}
    spec = obj["spec"]
    for role in ENGINE_ROLES:
        spec[role]["replicas"] = size
        spec[role]["gpusPerReplica"] = 1
    if mode == CONTROL_PLANE:
        spec["engine"]["image"] = FAKE_IMAGE
        spec["store"] = {"enabled": False}
        spec["gateway"] = {"enabled": False}
    return obj


# -- one measurement ------------------------------------------------------------------------------
@dataclass
class Steady:
    seconds: float
    op_cpu_s: float
    op_cpu_pct: float
    gw_cpu_pct: float | None
    op_rss_peak_mib: float
    writes: int
    writes_by: dict[str, int]
    reconciles: int
    events: int
    #: API reads by verb/kind (the Lease's included); empty from an operator before reads
    #: were counted
    reads_by: dict[str, int] = field(default_factory=dict)


@dataclass
class RunResult:
    mode: str
    size: int
    run: int
    name: str
    ready_s: float | None = None
    pods_created_s: float | None = None
    pods_ready_s: float | None = None
    op_cpu_s: float = 0.0
    gw_cpu_s: float | None = None
    op_rss_before_mib: float = 0.0
    op_rss_peak_mib: float = 0.0
    op_hwm_mib: float = 0.0
    gw_rss_peak_mib: float | None = None
    writes: int = 0
    writes_by: dict[str, int] = field(default_factory=dict)
    reconciles: int = 0
    reconciles_by: dict[str, int] = field(default_factory=dict)
    events: int = 0
    events_by: dict[str, int] = field(default_factory=dict)
    reasons: list[tuple[float, str]] = field(default_factory=list)
    teardown_s: float | None = None
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    steady: Steady | None = None
    error: str | None = None


class Bench:
    def __init__(self, http: Any, pod_pids_dir: Path, timeout_s: float, steady_s: float) -> None:
        self.http = http
        self.pod_pids_dir = pod_pids_dir
        self.timeout_s = timeout_s
        self.steady_s = steady_s
        self.tty = sys.stdout.isatty()

    def _line(self, text: str) -> None:
        if self.tty:
            print(f"\r\033[K  {text}", end="", flush=True)

    def measure(self, op: OperatorProc, mode: str, size: int, run: int,
                steady: bool) -> RunResult:
        name = f"{'real' if mode == REAL else 'cp'}-{size}x{size}-r{run}"
        res = RunResult(mode=mode, size=size, run=run, name=name, load_before=os.getloadavg())
        want = 2 * size
        watch = PodWatch(self.http, name, int(self.timeout_s) + 60)
        gw_pid = op.gateway_pid()
        metrics0 = scrape(op.metrics_url)
        cpu0, gw_cpu0 = cpu_seconds(op.pid), cpu_seconds(gw_pid)
        res.op_rss_before_mib = status_kib(op.pid, "VmRSS") / 1024
        peak, gw_peak = status_kib(op.pid, "VmRSS"), status_kib(gw_pid, "VmRSS")
        watch.start()
        t0 = time.monotonic()
        watch.t0 = t0
        try:
            self.http.post(cluster_path(), manifest(mode, name, size))
        except (OSError, RuntimeError) as err:  # e.g. the API server rejects the manifest
            watch.done.set()
            res.error = f"apply failed: {err}"
            log(f"  {name}: {res.error}")
            return res
        reason = ""
        ready = False
        next_poll = t0
        while True:
            now = time.monotonic()
            elapsed = now - t0
            peak = max(peak, status_kib(op.pid, "VmRSS"))
            gw_peak = max(gw_peak, status_kib(gw_pid, "VmRSS"))
            with contextlib.suppress(OSError, RuntimeError):
                ready, r = ready_condition(self.http.get(cluster_path(name)))
                if r != reason:
                    reason = r
                    res.reasons.append((round(elapsed, 2), r))
            if ready:
                break
            if not op.alive():
                res.error = f"operator exited:\n{op.log_tail()}"
                break
            if elapsed > self.timeout_s:
                res.error = f"not Ready after {self.timeout_s:.0f}s (Ready reason {reason!r})"
                break
            self._line(f"{name}: {elapsed:5.1f}s  pods created {len(watch.created)}/{want}  "
                       f"ready {len(watch.ready)}/{want}  Ready reason {reason or '-'}")
            next_poll += POLL_S
            time.sleep(max(0.0, next_poll - time.monotonic()))
        t_end = time.monotonic()
        cpu1, gw_cpu1 = cpu_seconds(op.pid), cpu_seconds(gw_pid)
        metrics1 = scrape(op.metrics_url)
        if self.tty:
            print("\r\033[K", end="", flush=True)
        if ready:
            res.ready_s = t_end - t0
        res.pods_created_s = watch.nth(watch.created, want)
        res.pods_ready_s = watch.nth(watch.ready, want)
        if watch.error:
            log(f"  pod watch broke: {watch.error}")
        res.op_cpu_s = cpu1 - cpu0
        res.gw_cpu_s = gw_cpu1 - gw_cpu0 if gw_pid is not None else None
        res.op_rss_peak_mib = peak / 1024
        res.op_hwm_mib = status_kib(op.pid, "VmHWM") / 1024
        res.gw_rss_peak_mib = gw_peak / 1024 if gw_pid is not None else None
        res.writes_by = diff(metrics1, metrics0, "writes:")
        res.writes = sum(res.writes_by.values())
        res.reconciles_by = diff(metrics1, metrics0, "reconciles:")
        res.reconciles = sum(res.reconciles_by.values())
        with contextlib.suppress(OSError, RuntimeError):
            res.events_by = cluster_events(self.http, name)
            res.events = sum(res.events_by.values())
        res.load_after = os.getloadavg()
        log(f"  {name}: " + (f"Ready in {res.ready_s:.2f}s" if res.ready_s is not None
                             else f"FAILED: {res.error}")
            + f"; pods created {fmt(res.pods_created_s)}s, k8s-ready {fmt(res.pods_ready_s)}s"
            + f"; operator CPU {res.op_cpu_s:.2f}s"
            + (f", gateway CPU {res.gw_cpu_s:.2f}s" if res.gw_cpu_s is not None else "")
            + f"; RSS {res.op_rss_before_mib:.0f}->{res.op_rss_peak_mib:.0f} MiB"
            + f"; writes {res.writes} {res.writes_by}; reconciles {res.reconciles}"
            + f"; events {res.events} {res.events_by}"
            + f"; load {res.load_before[0]:.1f}->{res.load_after[0]:.1f}")
        log(f"  {name}: Ready reasons over time: "
            + ", ".join(f"{t:.1f}s {r}" for t, r in res.reasons))
        if ready and steady and self.steady_s > 0:
            res.steady = self.steady_minute(op, name)
        watch.done.set()
        res.teardown_s = self.teardown(name)
        return res

    def steady_minute(self, op: OperatorProc, name: str) -> Steady:
        log(f"  {name}: steady state for {self.steady_s:.0f}s ...")
        gw_pid = op.gateway_pid()
        m0 = scrape(op.metrics_url)
        ev0 = sum(cluster_events(self.http, name).values())
        c0, g0 = cpu_seconds(op.pid), cpu_seconds(gw_pid)
        t0 = time.monotonic()
        peak = status_kib(op.pid, "VmRSS")
        while (left := self.steady_s - (time.monotonic() - t0)) > 0:
            time.sleep(min(1.0, left))
            peak = max(peak, status_kib(op.pid, "VmRSS"))
            self._line(f"{name}: steady {time.monotonic() - t0:4.0f}/{self.steady_s:.0f}s")
        secs = time.monotonic() - t0
        c1, g1 = cpu_seconds(op.pid), cpu_seconds(gw_pid)
        m1 = scrape(op.metrics_url)
        if self.tty:
            print("\r\033[K", end="", flush=True)
        writes_by = diff(m1, m0, "writes:")
        st = Steady(seconds=secs, op_cpu_s=c1 - c0, op_cpu_pct=100 * (c1 - c0) / secs,
                    gw_cpu_pct=100 * (g1 - g0) / secs if gw_pid is not None else None,
                    op_rss_peak_mib=peak / 1024, writes=sum(writes_by.values()),
                    writes_by=writes_by, reconciles=sum(diff(m1, m0, "reconciles:").values()),
                    events=sum(cluster_events(self.http, name).values()) - ev0,
                    reads_by=diff(m1, m0, "reads:"))
        log(f"  {name}: steady {secs:.0f}s: operator CPU {st.op_cpu_pct:.2f}% "
            f"({st.op_cpu_s:.2f}s), writes {st.writes} {st.writes_by}, reconciles "
            f"{st.reconciles}, reads {st.reads_by}, events {st.events}, RSS peak "
            f"{st.op_rss_peak_mib:.0f} MiB")
        return st

    def teardown(self, name: str) -> float | None:
        """Delete the cluster; wait for it, its pods and the runner's pod processes to go."""
        t0 = time.monotonic()
        with contextlib.suppress(RuntimeError):
            self.http.delete(cluster_path(name))
        sel = urllib.parse.quote(f"mooncake.io/cluster={name}")

        def gone() -> bool:
            try:
                self.http.get(cluster_path(name))
                return False
            except RuntimeError as err:
                if getattr(err, "status", None) != 404:
                    raise
            pods = self.http.get(f"{pods_path()}?labelSelector={sel}")["items"]
            return not pods and not self._pod_processes()

        try:
            wait_until(gone, 300, f"{name} and its pods to be gone", every=POLL_S)
        except TimeoutError as err:
            log(f"  {err}")
            return None
        took = time.monotonic() - t0
        log(f"  {name}: deleted, pods gone in {took:.1f}s")
        return took

    def _pod_processes(self) -> bool:
        from mooncake_localcluster import procs

        return any(procs.alive(r) for r in procs.records(self.pod_pids_dir))


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# -- summary --------------------------------------------------------------------------------------
def min_med(values: list[float | None], digits: int = 2) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    lo, med = min(vals), statistics.median(vals)
    return f"{lo:.{digits}f} / {med:.{digits}f}"


def summary(results: list[RunResult]) -> str:
    groups: dict[tuple[str, int], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.mode, r.size), []).append(r)
    head = ["mode", "pods", "ok", "apply->Ready s", "all pods created s", "all pods k8s-Ready s",
            "operator CPU s", "gateway CPU s", "operator RSS MiB (peak)", "API writes",
            "reconciles", "Events"]
    rows: list[list[str]] = []
    for (mode, size), rs in groups.items():
        ok = [r for r in rs if r.ready_s is not None]
        rows.append([
            MODE_TITLE[mode], f"{size}+{size}", f"{len(ok)}/{len(rs)}",
            min_med([r.ready_s for r in rs]),
            min_med([r.pods_created_s for r in rs]),
            min_med([r.pods_ready_s for r in rs]),
            min_med([r.op_cpu_s for r in ok]),
            min_med([r.gw_cpu_s for r in ok]),
            min_med([r.op_rss_peak_mib for r in ok], 0),
            min_med([float(r.writes) for r in ok], 0),
            min_med([float(r.reconciles) for r in ok], 0),
            min_med([float(r.events) for r in ok], 0),
        ])
    out = ["Each cell: min / median over the runs (CPU, RSS, writes: successful runs only).",
           "", table(head, rows)]
    steady = [(r, r.steady) for r in results if r.steady is not None]
    if steady:
        sh = ["steady state", "pods", "runs", "seconds", "operator CPU %", "gateway CPU %",
              "API writes", "reconciles", "Events", "operator RSS MiB (peak)"]
        srows: list[list[str]] = []
        sgroups: dict[tuple[str, int], list[Steady]] = {}
        for r, s in steady:
            sgroups.setdefault((r.mode, r.size), []).append(s)
        for (mode, size), ss in sgroups.items():
            srows.append([
                MODE_TITLE[mode], f"{size}+{size}", str(len(ss)),
                min_med([s.seconds for s in ss], 0),
                min_med([s.op_cpu_pct for s in ss]),
                min_med([s.gw_cpu_pct for s in ss]),
                min_med([float(s.writes) for s in ss], 0),
                min_med([float(s.reconciles) for s in ss], 0),
                min_med([float(s.events) for s in ss], 0),
                min_med([s.op_rss_peak_mib for s in ss], 0),
            ])
        out += ["", table(sh, srows)]
    failed = [r for r in results if r.error]
    if failed:
        out += ["", "Failed runs:"] + [f"  {r.name}: {r.error}" for r in failed]
    return "\n".join(out)


def table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
            for r in rows]
    return "\n".join([line, sep, *body])


# -- the local cluster ----------------------------------------------------------------------------
def missing_binaries(settings: Any) -> list[str] | None:
    """Runtime binaries not built yet (``None``: the Go wrapper modules are not found)."""
    from mooncake_localcluster import components

    try:
        tools = components.find_tools_dir(settings)
    except FileNotFoundError:
        return None
    missing = []
    for name in components.RUNTIME_COMPONENTS:
        path = components.binary_path(settings, components.component(name), tools)
        if not (path.is_file() and os.access(path, os.X_OK)):
            missing.append(name)
    return missing


@contextlib.contextmanager
def local_cluster(name: str, nodes_per_pool: int, keep: bool) -> Iterator[Any]:
    from mooncake_localcluster import cluster
    from mooncake_localcluster.settings import LocalClusterSettings
    from mooncake_testbed.localk8s import fresh_cluster

    settings = LocalClusterSettings(name=name, prefill_nodes=nodes_per_pool,
                                    decode_nodes=nodes_per_pool)
    with fresh_cluster(settings, keep, log) as (info, paths):
        log(f"  {nodes_per_pool} prefill + {nodes_per_pool} decode nodes of "
            f"{settings.node.gpus} GPUs")
        yield settings, paths, cluster.kube_client(paths, info.server)


def machine() -> JsonDict:
    mem_kib = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpus": os.cpu_count(), "cpu_model": model, "mem_gib": round(mem_kib / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version()}


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=2, help="measurements per mode and size")
    ap.add_argument("--sizes", default="4,32",
                    help="control-plane-only sizes N (N prefill + N decode pods)")
    ap.add_argument("--real-size", type=int, default=4,
                    help="size of the real-engines cluster (default 4: 4+4 worker processes)")
    ap.add_argument("--skip-real", action="store_true", help="only the control-plane mode")
    ap.add_argument("--steady-s", type=float, default=60.0,
                    help="steady-state window after Ready, for the largest size (0: none)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="apply->Ready limit per run")
    ap.add_argument("--json", dest="json_out", default=None, help="write every run here")
    ap.add_argument("--cluster-name", default="opbench", help="the local cluster's name")
    ap.add_argument("--keep-state", action="store_true",
                    help="do not purge the local cluster's state (logs) at the end")
    a = ap.parse_args(argv)
    try:
        a.size_list = sorted({int(s) for s in a.sizes.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--sizes: comma-separated integers, not {a.sizes!r}")
    if not a.size_list or min(a.size_list) < 1 or a.runs < 1 or a.real_size < 1:
        ap.error("--sizes, --real-size and --runs must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        from mooncake_localcluster.settings import LocalClusterSettings
    except ImportError:
        print("mooncake_localcluster is not importable; install the project first:\n"
              "  pip install -e .", file=sys.stderr)
        return 2
    settings = LocalClusterSettings(name=a.cluster_name)
    missing = missing_binaries(settings)
    if missing is None:
        print("cannot find tools/localcluster (the Go wrapper modules); run from a checkout "
              "or set MOONCAKE_LOCALCLUSTER_TOOLS_DIR", file=sys.stderr)
        return 2
    if missing:
        print(f"the embedded cluster's binaries are not built ({', '.join(missing)}); run\n"
              "  mooncake-operator local-cluster build      # ~13 min cold on 2 cores\n"
              "then run this benchmark again.", file=sys.stderr)
        return 2
    gpus = settings.node.gpus
    largest = max([*a.size_list, 0 if a.skip_real else a.real_size])
    nodes = max(4, -(-largest // gpus))  # 1 GPU per replica: one pool's pods on its nodes
    plan = [(CONTROL_PLANE, s) for s in a.size_list]
    if not a.skip_real:
        plan.append((REAL, a.real_size))
    log(f"operator scale benchmark: {a.runs} run(s) of "
        + ", ".join(f"{MODE_TITLE[m]} {s}+{s}" for m, s in plan)
        + f"; steady state {a.steady_s:.0f}s after {max(a.size_list)}+{max(a.size_list)}")
    log(f"machine: {machine()}; load {os.getloadavg()}")
    load_start = os.getloadavg()
    results: list[RunResult] = []
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="opbench-"))
    try:
        with local_cluster(a.cluster_name, nodes, a.keep_state) as (_s, paths, http):
            with contextlib.suppress(RuntimeError):
                http.post("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
            install_crd(http)
            bench = Bench(http, paths.pod_pids, a.timeout_s, a.steady_s)
            for mode in (CONTROL_PLANE, REAL):
                sizes = [s for m, s in plan if m == mode]
                if not sizes:
                    continue
                log(f"== {MODE_TITLE[mode]}: operator" + (" + gateway" if mode == REAL else ""))
                with run_operator(paths.kubeconfig, workdir, gateway=mode == REAL) as op:
                    for run in range(1, a.runs + 1):
                        for size in sizes:  # interleaved: noise spreads over the sizes
                            log(f"{MODE_TITLE[mode]} {size}+{size}, run {run}/{a.runs}")
                            steady = mode == CONTROL_PLANE and size == max(a.size_list)
                            results.append(bench.measure(op, mode, size, run, steady))
    except KeyboardInterrupt:
        log("interrupted; summary of what was measured:")
    load_end = os.getloadavg()
    text = summary(results) if results else "nothing measured"
    print()
    print(text)
    print(f"\nload average (1/5/15 min) at start {fmt_load(load_start)}, "
          f"at end {fmt_load(load_end)}; {os.cpu_count()} CPUs; "
          f"wall {time.time() - started:.0f}s; operator logs in {workdir}")
    if a.json_out:
        script = Path(__file__).resolve()
        with contextlib.suppress(ValueError):
            script = script.relative_to(Path.cwd())
        doc = {"command": " ".join(["python", str(script), *(argv or sys.argv[1:])]),
               "machine": machine(), "operator_settings": operator_settings(),
               "started": started, "load_start": load_start, "load_end": load_end,
               "sizes": a.size_list, "real_size": a.real_size, "runs": a.runs,
               "steady_s": a.steady_s,
               "results": [asdict(r) for r in results], "summary": text}
        Path(a.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        log(f"wrote {a.json_out}")
    return 0 if results and all(r.error is None for r in results) else 1


def operator_settings() -> JsonDict:
    """The operator's timing settings in effect (defaults unless set in the environment)."""
    from mooncake_operator.settings import OperatorSettings

    st = OperatorSettings()
    return {"resync_interval_s": st.resync_interval_s, "busy_interval_s": st.busy_interval_s,
            "event_debounce_s": st.event_debounce_s, "log_level": "INFO"}


def fmt_load(load: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in load)


if __name__ == "__main__":
    sys.exit(main())
