"""Start, stop and inspect the local control plane (etcd, apiserver, kcm, scheduler, kwok)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel

from mooncake_localcluster import components, manifests, podnet, procs
from mooncake_localcluster.certs import PkiPaths, ensure_pki
from mooncake_localcluster.kubehttp import STRATEGIC_PATCH, ApiError, KubeHttp
from mooncake_localcluster.settings import NETWORK_SLOTS, LocalClusterSettings

Log = Callable[[str], None]
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
POD_RUNNER = "pod-runner"
SERVICE_PROXY = "service-proxy"
# Our Python helpers: name -> module run with ``python -m``; `down` stops them first.
HELPERS = {
    POD_RUNNER: "mooncake_localcluster.podrunner",
    SERVICE_PROXY: "mooncake_localcluster.serviceproxy",
}
KUBERNETES_SERVICE_PATH = "/api/v1/namespaces/default/services/kubernetes"
KUBERNETES_SERVICE_PORT = 443  # fixed by the apiserver
PORT_NAMES = ("etcd", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok")
# Start order; `down` stops in reverse.
PROCESS_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
HTTP_PROBE_TIMEOUT_S = 2.0
REQUIRED_ADMISSION_PLUGINS = ("ServiceAccount", "PodSecurity")
KUBERNETES_SERVICE_WAIT_S = 15.0
UNPRIVILEGED_PORT_START = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")


@dataclass(frozen=True)
class StatePaths:
    root: Path

    @property
    def pki(self) -> PkiPaths:
        return PkiPaths(self.root / "pki")

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def pod_pids(self) -> Path:
        return self.root / "pod-pids"

    @property
    def pods(self) -> Path:
        return self.root / "pods"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd-data"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def cluster_json(self) -> Path:
        return self.root / "cluster.json"

    @property
    def settings_json(self) -> Path:
        return self.root / "settings.json"

    @property
    def kwok_config(self) -> Path:
        return self.root / "kwok.yaml"

    def cert_dir(self, component: str) -> Path:
        return self.root / "certs" / component


class ClusterInfo(BaseModel):
    """What ``up`` wrote: enough for ``status``, the pod runner and tests."""

    name: str
    host: str
    ports: dict[str, int]
    kubeconfig: str
    state_dir: str
    versions: dict[str, str]
    started_at: float
    pod_cidr_prefix: str = ""
    service_cidr: str = ""

    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.ports['apiserver']}"


def state_paths(settings: LocalClusterSettings) -> StatePaths:
    return StatePaths(settings.resolved_state_dir())


def load_info(paths: StatePaths) -> ClusterInfo | None:
    try:
        return ClusterInfo.model_validate_json(paths.cluster_json.read_text())
    except (OSError, ValueError):
        return None


def kube_client(paths: StatePaths, server: str) -> KubeHttp:
    pki = paths.pki
    return KubeHttp(server, pki.ca_crt, pki.admin_crt, pki.admin_key)


def _choose_ports(settings: LocalClusterSettings, previous: ClusterInfo | None) -> dict[str, int]:
    ports: dict[str, int] = {}
    for name in PORT_NAMES:
        old = previous.ports.get(name) if previous else None
        if old and old not in ports.values() and procs.port_free(settings.host, old):
            ports[name] = old
            continue
        port = procs.free_port(settings.host)
        while port in ports.values():
            port = procs.free_port(settings.host)
        ports[name] = port
    return ports


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_PROBE_TIMEOUT_S, context=ctx) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _insecure_ctx() -> ssl.SSLContext:
    """For the kcm/scheduler /healthz probes only: their serving certs are self-signed."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _wait(
    what: str,
    check: Callable[[], bool],
    settings: LocalClusterSettings,
    paths: StatePaths,
    proc_name: str | None,
) -> None:
    deadline = time.monotonic() + settings.ready_timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if proc_name is not None:
            record = procs.PidRecord.read(paths.pids / f"{proc_name}{procs.PID_SUFFIX}")
            if record is None or not procs.alive(record):
                raise RuntimeError(f"{proc_name} exited; see {paths.logs / proc_name}.log")
        time.sleep(settings.poll_interval_s)
    raise TimeoutError(f"{what} not ready after {settings.ready_timeout_s}s; logs in {paths.logs}")


def _argv(
    name: str,
    binary: Path,
    settings: LocalClusterSettings,
    paths: StatePaths,
    ports: dict[str, int],
) -> list[str]:
    host = settings.host
    pki = paths.pki
    kubeconfig = str(paths.kubeconfig)
    if name == "etcd":
        client = f"http://{host}:{ports['etcd']}"
        peer = f"http://{host}:{ports['etcd_peer']}"
        return [
            str(binary),
            "--name=local",
            f"--data-dir={paths.etcd_data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
    if name == "kube-apiserver":
        return [
            str(binary),
            f"--etcd-servers=http://{host}:{ports['etcd']}",
            f"--bind-address={host}",
            f"--advertise-address={host}",
            f"--secure-port={ports['apiserver']}",
            f"--cert-dir={paths.cert_dir(name)}",
            f"--tls-cert-file={pki.serving_crt}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_crt}",
            f"--service-cluster-ip-range={settings.service_range()}",
            "--authorization-mode=RBAC",
            # Both are on by default; named so that no flag here ever turns them off: pods
            # get their ServiceAccount's token volume, namespaces enforce Pod Security.
            f"--enable-admission-plugins={','.join(REQUIRED_ADMISSION_PLUGINS)}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--allow-privileged=true",
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kube-controller-manager":
        return [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--controllers=*",
            # kwok's heartbeats can lag on a small host starting dozens of pod processes at
            # once; the default 50 s then marks nodes (and their pods) NotReady for nothing
            f"--node-monitor-grace-period={settings.node_monitor_grace_s}s",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_crt}",
            f"--cluster-signing-cert-file={pki.ca_crt}",
            f"--cluster-signing-key-file={pki.ca_key}",
            f"--bind-address={host}",
            f"--secure-port={ports['controller_manager']}",
            f"--cert-dir={paths.cert_dir(name)}",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kube-scheduler":
        return [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            f"--bind-address={host}",
            f"--secure-port={ports['scheduler']}",
            f"--cert-dir={paths.cert_dir(name)}",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kwok":
        selector = f"{settings.kwok_node_annotation}={settings.kwok_node_annotation_value}"
        return [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--config={paths.kwok_config}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={selector}",
            f"--node-ip={host}",
            f"--server-address={host}:{ports['kwok']}",
        ]
    raise KeyError(name)


def _ready_check(
    name: str, settings: LocalClusterSettings, paths: StatePaths, ports: dict[str, int]
) -> Callable[[], bool]:
    host = settings.host
    if name == "etcd":
        return lambda: _http_ok(f"http://{host}:{ports['etcd']}/health")
    if name == "kube-apiserver":
        client = kube_client(paths, f"https://{host}:{ports['apiserver']}")

        def api_ready() -> bool:
            try:
                return client.get_text("/readyz", timeout=HTTP_PROBE_TIMEOUT_S) == "ok"
            except (ApiError, OSError, ValueError):
                return False

        return api_ready
    if name in ("kube-controller-manager", "kube-scheduler"):
        key = "controller_manager" if name == "kube-controller-manager" else "scheduler"
        ctx = _insecure_ctx()
        return lambda: _http_ok(f"https://{host}:{ports[key]}/healthz", ctx)
    return lambda: True


def running_records(paths: StatePaths) -> list[procs.PidRecord]:
    return [r for r in procs.records(paths.pids) if procs.alive(r)]


def is_up(settings: LocalClusterSettings) -> bool:
    paths = state_paths(settings)
    info = load_info(paths)
    if info is None:
        return False
    alive = {r.name for r in running_records(paths)}
    if not set(PROCESS_ORDER) | set(HELPERS) <= alive:
        return False
    return _ready_check("kube-apiserver", settings, paths, info.ports)()


def _apply_nodes(client: KubeHttp, settings: LocalClusterSettings, log: Log) -> None:
    for node in manifests.all_nodes(settings):
        name = node["metadata"]["name"]
        try:
            client.post("/api/v1/nodes", node)
        except ApiError as err:
            if err.status != 409:
                raise
            patch = {"metadata": node["metadata"], "spec": node["spec"]}
            client.patch(f"/api/v1/nodes/{name}", patch, STRATEGIC_PATCH)
        status = {"status": {k: node["status"][k] for k in ("capacity", "allocatable")}}
        client.patch(f"/api/v1/nodes/{name}/status", status, STRATEGIC_PATCH)
    log(
        f"nodes: {settings.prefill_nodes} prefill + {settings.decode_nodes} decode GPU nodes, "
        f"{settings.cpu_nodes} CPU node(s)"
    )


def _nodes_ready(client: KubeHttp, settings: LocalClusterSettings) -> bool:
    try:
        nodes = client.get("/api/v1/nodes")["items"]
    except (ApiError, OSError):
        return False
    wanted = {name for name, _ in manifests.node_names(settings)}
    ready = set()
    for node in nodes:
        for cond in (node.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready" and cond.get("status") == "True":
                ready.add(node["metadata"]["name"])
    return wanted <= ready


def _kubernetes_service_ip(client: KubeHttp) -> str | None:
    try:
        ip = client.get(KUBERNETES_SERVICE_PATH)["spec"].get("clusterIP")
    except (ApiError, OSError, KeyError):
        return None
    return str(ip) if ip else None


NETWORK_FIELDS = ("network_slot", "pod_cidr_prefix", "service_cidr")


def _recorded_network(paths: StatePaths) -> dict[str, object] | None:
    """The network settings etcd's objects were made with (None for a fresh state)."""
    if not paths.settings_json.is_file() or not paths.etcd_data.exists():
        return None
    try:
        raw = json.loads(paths.settings_json.read_text())
    except (OSError, ValueError):
        return None
    return {key: raw.get(key) for key in NETWORK_FIELDS}


def network_claims(settings: LocalClusterSettings) -> list[str]:
    return [f"pods/{settings.pod_prefix()}", f"services/{settings.service_range()}"]


def resolve_network(
    settings: LocalClusterSettings, paths: StatePaths
) -> tuple[LocalClusterSettings, list[socket.socket]]:
    """Fix the network slot and hold its ranges host-wide (see ``procs.claim``).

    A fresh state takes the first slot no running local cluster holds; an existing one
    keeps the ranges its objects were made with (node podCIDRs and ClusterIPs do not
    change), and explicit settings that differ from them are an error.
    """
    recorded = _recorded_network(paths)
    purge = f"run `local-cluster down --purge` first (deletes the objects in {paths.root})"
    if recorded is not None:
        if recorded["network_slot"] is None:
            raise RuntimeError(
                f"the state was made before Services got loopback ClusterIPs: {purge}"
            )
        for key, value in recorded.items():
            explicit = getattr(settings, key)
            if explicit is not None and explicit != value:
                raise RuntimeError(
                    f"the state was made with {key}={value}, not {explicit}: {purge}"
                )
        candidates = [LocalClusterSettings.model_validate(settings.model_dump() | recorded)]
    elif settings.network_slot is not None:
        candidates = [settings.with_slot(settings.network_slot)]
    else:
        candidates = [settings.with_slot(slot) for slot in range(NETWORK_SLOTS)]
    for candidate in candidates:
        held = [procs.claim(name) for name in network_claims(candidate)]
        sockets = [sock for sock in held if sock is not None]
        # A proxy that holds no claim (an older version) may still serve the range.
        api = (candidate.kubernetes_service_ip(), KUBERNETES_SERVICE_PORT)
        if len(sockets) == len(held) and not procs.listening(*api):
            return candidate, sockets
        for sock in sockets:
            sock.close()
    tried = " + ".join(network_claims(candidates[0]))
    more = f" (and the {len(candidates) - 1} other slots)" if len(candidates) > 1 else ""
    raise RuntimeError(f"other running local clusters on this host hold {tried}{more}")


def up(settings: LocalClusterSettings, log: Log = print) -> ClusterInfo:
    """Start everything (building binaries first if needed); idempotent."""
    paths = state_paths(settings)
    previous = load_info(paths)
    if previous is not None and is_up(settings):
        log(f"local cluster {settings.name!r} is already running: {previous.server}")
        log(f"kubeconfig: {previous.kubeconfig}")
        return previous
    if running_records(paths) or procs.records(paths.pod_pids):
        log("a previous start is partly running; stopping it first")
        down(settings, log)
    settings, claims = resolve_network(settings, paths)
    try:
        return _start(settings, paths, previous, claims, log)
    finally:
        for sock in claims:
            sock.close()


def _start(
    settings: LocalClusterSettings,
    paths: StatePaths,
    previous: ClusterInfo | None,
    claims: list[socket.socket],
    log: Log,
) -> ClusterInfo:
    started = time.monotonic()
    binaries = components.build_all(settings, components.RUNTIME_COMPONENTS, log)
    tools_dir = components.find_tools_dir(settings)
    versions = {
        name: components.component_version(components.component(name), tools_dir)
        for name in components.RUNTIME_COMPONENTS
    }
    paths.root.mkdir(parents=True, exist_ok=True)
    pki = ensure_pki(paths.pki.root, settings.host, (settings.kubernetes_service_ip(),))
    ports = _choose_ports(settings, previous)
    server = f"https://{settings.host}:{ports['apiserver']}"
    config = manifests.kubeconfig(
        server, pki.ca_crt.read_bytes(), pki.admin_crt.read_bytes(), pki.admin_key.read_bytes()
    )
    paths.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
    paths.kubeconfig.chmod(0o600)
    paths.kwok_config.write_text(manifests.kwok_config(settings))
    paths.settings_json.write_text(settings.model_dump_json(indent=2))
    info = ClusterInfo(
        name=settings.name,
        host=settings.host,
        ports=ports,
        kubeconfig=str(paths.kubeconfig),
        state_dir=str(paths.root),
        versions=versions,
        started_at=time.time(),
        pod_cidr_prefix=settings.pod_prefix(),
        service_cidr=settings.service_range(),
    )
    paths.cluster_json.write_text(info.model_dump_json(indent=2))
    try:
        for name in PROCESS_ORDER:
            for d in (paths.cert_dir(name),):
                d.mkdir(parents=True, exist_ok=True)
            if name == "kwok":
                podnet.release_pod_addresses(kube_client(paths, server), log)
            argv = _argv(name, binaries[name], settings, paths, ports)
            procs.start(name, argv, paths.logs / f"{name}.log", paths.pids)
            if name in ("etcd", "kube-apiserver"):
                _wait(name, _ready_check(name, settings, paths, ports), settings, paths, name)
                log(f"{name} ready ({time.monotonic() - started:.1f}s)")
        client = kube_client(paths, server)
        _apply_nodes(client, settings, log)
        # The runner gives containers the `kubernetes` Service's variables: wait for it.
        _wait(
            "the kubernetes Service",
            lambda: _kubernetes_service_ip(client) == settings.kubernetes_service_ip(),
            settings,
            paths,
            "kube-apiserver",
        )
        for helper in HELPERS:
            # The service proxy holds the network claims for as long as it runs.
            fds = [sock.fileno() for sock in claims] if helper == SERVICE_PROXY else []
            start_helper(helper, paths, fds)
        for name in ("kube-controller-manager", "kube-scheduler"):
            _wait(name, _ready_check(name, settings, paths, ports), settings, paths, name)
        _wait_kubernetes_service(settings, log)
        _wait("nodes", lambda: _nodes_ready(client, settings), settings, paths, "kwok")
    except BaseException:
        log(f"start failed; stopping what was started (logs in {paths.logs})")
        down(settings, log)
        raise
    log(f"local cluster {settings.name!r} up in {time.monotonic() - started:.1f}s: {server}")
    log(f"kubeconfig: {paths.kubeconfig}")
    return info


def _wait_kubernetes_service(settings: LocalClusterSettings, log: Log) -> None:
    """Pods reach the API server at the ``kubernetes`` ClusterIP:443: wait until the
    service proxy serves it, when it can (else the pod runner hands pods the API server's
    own address, see ``podrunner``)."""
    address = (settings.kubernetes_service_ip(), KUBERNETES_SERVICE_PORT)
    if can_bind_port(KUBERNETES_SERVICE_PORT):
        deadline = time.monotonic() + KUBERNETES_SERVICE_WAIT_S
        while time.monotonic() < deadline:
            if procs.listening(*address):
                return
            time.sleep(settings.poll_interval_s)
    log(
        f"the service proxy does not serve {address[0]}:{address[1]} (port 443 needs root or"
        " a lowered net.ipv4.ip_unprivileged_port_start): pods get the API server's own"
        " address in KUBERNETES_SERVICE_HOST/PORT"
    )


def can_bind_port(port: int) -> bool:
    """Whether this process may listen on ``port`` (root, or a low enough
    ``net.ipv4.ip_unprivileged_port_start``)."""
    try:
        start = int(UNPRIVILEGED_PORT_START.read_text())
    except (OSError, ValueError):
        start = 1024
    return port >= start or os.geteuid() == 0


def start_helper(name: str, paths: StatePaths, pass_fds: list[int] | None = None) -> None:
    """Start the pod runner or the service proxy (``python -m <module> --state-dir``)."""
    argv = [sys.executable, "-m", HELPERS[name], "--state-dir", str(paths.root)]
    # The marker must identify the helper, not just "python".
    log_path = paths.logs / f"{name}.log"
    procs.start(name, argv, log_path, paths.pids, marker=str(paths.root), pass_fds=pass_fds or [])


def down(settings: LocalClusterSettings, log: Log = print) -> int:
    """Stop every process started for this cluster (pod processes first). Returns the count."""
    paths = state_paths(settings)
    stopped = 0
    order = [*HELPERS, *reversed(PROCESS_ORDER)]
    by_name = {r.name: r for r in procs.records(paths.pids)}
    names = [n for n in order if n in by_name] + [n for n in by_name if n not in order]
    for name in names:
        if procs.stop_record(by_name[name], paths.pids, settings.stop_timeout_s):
            log(f"stopped {name} (pid {by_name[name].pid})")
            stopped += 1
    for record in procs.records(paths.pod_pids):
        if procs.stop_record(record, paths.pod_pids, settings.stop_timeout_s):
            log(f"stopped pod process {record.name} (pid {record.pid})")
            stopped += 1
    if stopped == 0:
        log(f"local cluster {settings.name!r}: nothing was running")
    return stopped


def restart(
    settings: LocalClusterSettings, name: str, log: Log = print, down_s: float = 0.0
) -> float:
    """Stop one control-plane process of a running cluster (SIGTERM, SIGKILL after
    ``stop_timeout_s``), leave it down ``down_s`` seconds, start it again with the same
    ports, flags and data, and wait until it answers. Returns the seconds from the stop to
    ready. For fault drills (``benchmarks/chaos.py``): an API-server or etcd restart."""
    if name not in PROCESS_ORDER:
        raise KeyError(f"{name!r} is not one of {', '.join(PROCESS_ORDER)}")
    if name == "kwok":
        raise KeyError("kwok keeps pod addresses in memory only: restarted alone, it would"
                       " hand running pods' addresses to new pods; use down and up")
    paths = state_paths(settings)
    info = load_info(paths)
    if info is None:
        raise RuntimeError(f"no cluster.json in {paths.root}: is the cluster up?")
    binary = components.binary_path(
        settings, components.component(name), components.find_tools_dir(settings)
    )
    started = time.monotonic()
    record = procs.PidRecord.read(paths.pids / f"{name}{procs.PID_SUFFIX}")
    if record is not None:
        procs.stop_record(record, paths.pids, settings.stop_timeout_s)
    log(f"stopped {name}")
    if down_s > 0:
        time.sleep(down_s)
    argv = _argv(name, binary, settings, paths, info.ports)
    procs.start(name, argv, paths.logs / f"{name}.log", paths.pids)
    _wait(name, _ready_check(name, settings, paths, info.ports), settings, paths, name)
    took = time.monotonic() - started
    log(f"{name} ready again {took:.1f}s after the stop")
    return took


def purge(settings: LocalClusterSettings, log: Log = print) -> None:
    """Delete the state dir of a stopped cluster."""
    paths = state_paths(settings)
    if running_records(paths):
        raise RuntimeError("cluster is still running; run down first")
    if paths.root.exists():
        shutil.rmtree(paths.root)
        log(f"removed {paths.root}")


def status(settings: LocalClusterSettings) -> dict[str, object]:
    paths = state_paths(settings)
    info = load_info(paths)
    processes = []
    for record in procs.records(paths.pids) + procs.records(paths.pod_pids):
        is_alive = procs.alive(record)
        rss = sum(procs.rss_kib(p) for p in procs.group_pids(record.pid)) if is_alive else 0
        processes.append(
            {"name": record.name, "pid": record.pid, "alive": is_alive, "rss_kib": rss}
        )
    return {
        "name": settings.name,
        "state_dir": str(paths.root),
        "running": is_up(settings),
        "server": info.server if info else None,
        "ports": info.ports if info else {},
        "pod_cidr_prefix": info.pod_cidr_prefix if info else None,
        "service_cidr": info.service_cidr if info else None,
        "versions": info.versions if info else {},
        "kubeconfig": str(paths.kubeconfig),
        "processes": processes,
        "total_rss_mib": round(sum(int(str(p["rss_kib"])) for p in processes) / 1024, 1),
    }


def format_status(data: dict[str, object]) -> str:
    return json.dumps(data, indent=2)


def open_state(state_dir: Path, log: Callable[[str], None]
               ) -> tuple[LocalClusterSettings, StatePaths, ClusterInfo] | None:
    """What a helper process of a running cluster (pod runner, service proxy) starts from:
    the settings ``up`` used, the state paths and ``cluster.json`` (``None``, logged, when
    there is none)."""
    settings = read_settings(state_dir)
    paths = StatePaths(state_dir)
    info = load_info(paths)
    if info is None:
        log(f"no cluster.json in {state_dir}")
        return None
    return settings, paths, info


def read_settings(state_dir: Path) -> LocalClusterSettings:
    """The settings ``up`` used, for the pod runner (a separate process)."""
    raw = json.loads((state_dir / "settings.json").read_text())
    with contextlib.suppress(KeyError):
        raw["state_dir"] = str(state_dir)
    return LocalClusterSettings.model_validate(raw)
