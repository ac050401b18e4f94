"""The pod runner: runs containers of our own images as local processes on the pod IP.

It watches pods bound to the fake nodes. For a runnable pod (image contains one of
``settings.runnable_image_substrings`` or label ``mooncake.io/runnable: "true"``) kwok
only assigns the pod IP (see ``manifests.kwok_stages``); this runner then starts each
container's command+args (or the image entrypoint, from ``images/*/Dockerfile`` and
``settings.image_entrypoints``, + args) locally with the kubelet's Service variables,
keeps downward-API, configMap, secret and projected volumes materialized (and refreshed)
in a per-pod directory, reports container states, readiness (with a kubelet's probe
thresholds, ``readiness``) and exit codes by patching the pod status, restarts per
``restartPolicy`` and stops the processes when the pod goes.

Credentials like a kubelet's: a projected ``serviceAccountToken`` source gets a real token
for the pod's ServiceAccount from the TokenRequest API (refreshed at 80% of its
lifetime, see ``tokens``), and each container runs in its own mount namespace
(``mountns``) where the mounts under ``/var/run/secrets/`` and a managed ``/etc/hosts``
are bind-mounted at their real paths, so in-cluster clients find the token, the CA and
the namespace where they look. Pod processes never get the admin kubeconfig.

Scale: one loop thread handles watch events and a status tick at most every ``TICK_S``;
readiness probes and process stops run in thread pools, so a slow probe or a container
that ignores SIGTERM never holds up the other pods.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_kube.listwatch import SYNC, Emit, fold, follow, object_ref

from mooncake_localcluster import (
    bindpin,
    images,
    mountns,
    podspec,
    procs,
    services,
    tokens,
    volumes,
)
from mooncake_localcluster.cluster import (
    KUBERNETES_SERVICE_PORT,
    StatePaths,
    kube_client,
    open_state,
)
from mooncake_localcluster.kubehttp import STRATEGIC_PATCH, ApiError, KubeHttp
from mooncake_localcluster.readiness import Readiness, probe_timeout_s
from mooncake_localcluster.settings import LocalClusterSettings

log = logging.getLogger("mooncake.localcluster.podrunner")
JsonDict = dict[str, Any]
Known = dict[tuple[str, str], JsonDict] | None  # objects by (resource, name), already at hand

TICK_S = 0.25
PROBE_INTERVAL_CAP_S = 1.0
BACKOFF_MAX_S = 30.0
RETRY_DELAY_S = 1.0
NO_COMMAND_EXIT = 127
STOP_WORKERS = 8
#: tries of a terminated pod's final delete while the API server does not answer, before
#: the runner's loop is asked to start over (``RETRY_FINAL_DELETE``)
FINAL_DELETE_TRIES = 30
RETRY_FINAL_DELETE = "RETRY_FINAL_DELETE"
# Variables a parent cluster (or the user who ran `up`) may have set for the runner
# itself: never inherited. A pod process talks to the API server with its own token only.
INHERITED_PREFIXES = ("KUBERNETES_SERVICE_", "KUBERNETES_PORT", "KUBECONFIG")
# Mounts at these paths (and below) are bind-mounted for real in the container's mount
# namespace, the rest are rewritten in command/args/env (see ``podspec.MountRewrite``).
BIND_MOUNT_ROOTS = ("/var/run/secrets", "/run/secrets")
HOSTS_PATH = "/etc/hosts"
TOKEN_RETRY_S = 10.0

PODS = "pods"
SERVICES = "services"
CONFIGMAPS = "configmaps"
SECRETS = "secrets"
# A volume source kind -> (resource, the field naming the object).
SOURCE_REFS = {"configMap": (CONFIGMAPS, "name"), "secret": (SECRETS, "secretName")}
KUBERNETES_PORT_NAME = "https"
# Probes must reach the pod IP directly, whatever *_proxy variables say.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerProc:
    name: str
    image: str
    container: JsonDict
    proc: subprocess.Popen[bytes] | None = None
    record: procs.PidRecord | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    restart_count: int = 0
    last_probe: float = 0.0
    restart_at: float | None = None
    last_terminated: JsonDict | None = None
    message: str = ""
    probe_future: Future[bool] | None = None
    readiness: Readiness = field(default_factory=Readiness)
    in_mount_ns: bool = False

    @property
    def ready(self) -> bool:
        return self.readiness.ready


@dataclass
class RunningPod:
    uid: str
    namespace: str
    name: str
    pod_ip: str
    directory: Path
    containers: list[ContainerProc]
    restart_policy: str
    volumes: list[JsonDict] = field(default_factory=list)
    meta_digest: str = ""
    last_status: JsonDict = field(default_factory=dict)
    done: bool = False
    pod: JsonDict = field(default_factory=dict)  # the latest object seen
    # (volume name, source index) -> the token of a serviceAccountToken source
    issued_tokens: dict[tuple[str, int], tokens.Token] = field(default_factory=dict)
    token_retry_at: float = 0.0  # monotonic: no refresh attempt before this
    mount_errors: dict[str, str] = field(default_factory=dict)  # volume name -> why


def _link_nested_mounts(rewrites: list[podspec.MountRewrite]) -> None:
    """A mount inside another mount's path shows up there, as a symlink."""
    for inner in rewrites:
        for outer in rewrites:
            outer_path = outer.mount_path.rstrip("/")
            if inner is outer or not inner.mount_path.startswith(outer_path + "/"):
                continue
            link = Path(outer.local_dir) / inner.mount_path[len(outer_path) + 1 :]
            if link.is_symlink() or link.exists():
                continue
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(inner.local_dir)


def probe_once(pod_ip: str, container: JsonDict, probe: JsonDict) -> bool:
    """One readiness probe (``httpGet`` or ``tcpSocket``; others count as success)."""
    port = probe_port(container, probe)
    if "httpGet" in probe and port is not None:
        get = probe["httpGet"]
        scheme = str(get.get("scheme", "HTTP")).lower()
        host = get.get("host") or pod_ip
        url = f"{scheme}://{host}:{port}{get.get('path', '/')}"
        try:
            with _NO_PROXY_OPENER.open(url, timeout=probe_timeout_s(probe)) as resp:
                return 200 <= int(resp.status) < 400
        except (urllib.error.URLError, OSError, ValueError):
            return False
    if "tcpSocket" in probe and port is not None:
        try:
            with socket.create_connection((pod_ip, port), timeout=probe_timeout_s(probe)):
                return True
        except OSError:
            return False
    return True


def probe_port(container: JsonDict, probe: JsonDict) -> int | None:
    action = probe.get("httpGet") or probe.get("tcpSocket") or {}
    port = action.get("port")
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    with contextlib.suppress(TypeError, ValueError):
        return int(str(port))
    return None


def volume_ref(volume: JsonDict) -> tuple[str, str] | None:
    """(resource, object name) for a configMap or secret volume."""
    for source, (resource, name_field) in SOURCE_REFS.items():
        if source in volume:
            return resource, str((volume[source] or {}).get(name_field, ""))
    return None


def volume_refs(volume: JsonDict) -> list[tuple[str, str]]:
    """(resource, object name) of every ConfigMap/Secret a volume shows (projected too)."""
    ref = volume_ref(volume)
    return [ref] if ref is not None else podspec.projected_refs(volume)


def is_bind_mount(mount_path: str) -> bool:
    """Whether the runner bind-mounts a volume at its real path (``BIND_MOUNT_ROOTS``)."""
    path = mount_path.rstrip("/")
    return any(path == root or path.startswith(root + "/") for root in BIND_MOUNT_ROOTS)


def mount_error_message(log_path: Path) -> str:
    """The mount helper's error line from a container log ('' when there is none)."""
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(0, os.SEEK_END)
            log_file.seek(max(0, log_file.tell() - 4096))
            tail = log_file.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in tail.splitlines() if ln.startswith(mountns.ERROR_PREFIX)]
    return lines[-1] if lines else ""


def source_files(volume: JsonDict, resource: str, obj: JsonDict) -> dict[str, bytes]:
    """The files of a configMap/secret volume, from the object (``{}`` if absent)."""
    if resource == CONFIGMAPS:
        return podspec.config_map_files(volume, podspec.config_map_data(obj))
    return podspec.secret_files(volume, podspec.secret_data(obj))


class PodRunner:
    def __init__(self, settings: LocalClusterSettings, paths: StatePaths, client: KubeHttp):
        self.settings = settings
        self.paths = paths
        self.client = client
        self.pods: dict[str, RunningPod] = {}
        self.events: queue.Queue[tuple[str, str, JsonDict]] = queue.Queue()
        self.stopping = threading.Event()
        self.services: dict[tuple[str, str], JsonDict] = {}
        self.services_synced = threading.Event()
        # (resource, namespace, name) -> uids of running pods with such a volume.
        self.volume_users: dict[tuple[str, str, str], set[str]] = {}
        # uids of terminating pods whose containers are stopping, or whose final delete is sent
        self.finalizing: set[str] = set()
        self.prober = ThreadPoolExecutor(settings.probe_workers, thread_name_prefix="probe")
        self.stopper = ThreadPoolExecutor(STOP_WORKERS, thread_name_prefix="stop")
        self.last_tick = 0.0
        self.entrypoints = images.entrypoint_table(
            settings.images_dir or images.find_images_dir(), settings.image_entrypoints
        )
        self._mount_ns_error: str | None = None
        self._mount_ns_checked = False
        self._kubernetes_served = False
        self.bind_pin = bindpin.built(settings)
        if self.bind_pin is None:
            log.warning("no bind pin built (mooncake-operator local-cluster build): pods "
                        "that listen on every interface are reachable from outside the host")

    # ----- watching -----------------------------------------------------------------
    def _emitter(self, resource: str) -> Emit:
        return lambda kind, obj: self.events.put((resource, kind, obj))

    def _watch(self, resource: str) -> None:
        on_sync = self.services_synced.set if resource == SERVICES else None
        follow(
            self.client.client,
            f"/api/v1/{resource}",
            self._emitter(resource),
            self.stopping,
            on_sync=on_sync,
        )

    def _watch_pods(self) -> None:
        # Containers get the Services as env: the first Service list goes first (FIFO).
        while not self.services_synced.wait(RETRY_DELAY_S):
            if self.stopping.is_set():
                return
        follow(
            self.client.client,
            "/api/v1/pods",
            self._emitter(PODS),
            self.stopping,
            {"fieldSelector": "spec.nodeName!="},
        )

    # ----- event handling -----------------------------------------------------------
    def handle(self, resource: str, kind: str, obj: JsonDict) -> None:
        if resource == PODS:
            self._handle_pod(kind, obj)
        elif resource == SERVICES:
            self._handle_service(kind, obj)
        else:
            self._handle_source(resource, kind, obj)

    def _handle_pod(self, kind: str, obj: JsonDict) -> None:
        if kind == SYNC:
            seen = set()
            for pod in obj["items"]:
                seen.add(pod["metadata"]["uid"])
                self._on_pod(pod)
            for uid in list(self.pods):
                if uid not in seen:
                    self._stop_pod(uid, "pod gone")
            self.finalizing &= seen
            return
        uid = (obj.get("metadata") or {}).get("uid", "")
        if kind == "DELETED":
            self.finalizing.discard(uid)
            self._stop_pod(uid, "pod deleted")
        elif kind == RETRY_FINAL_DELETE:
            self.finalizing.discard(uid)
            self._on_pod(obj)
        else:
            self._on_pod(obj)

    def _handle_service(self, kind: str, obj: JsonDict) -> None:
        self.services = fold(self.services, kind, obj, object_ref)

    def _handle_source(self, resource: str, kind: str, obj: JsonDict) -> None:
        """A ConfigMap/Secret changed: rewrite the volumes of running pods that use it."""
        if kind == "DELETED":
            return  # like the kubelet, the files keep their last content
        items = obj["items"] if kind == SYNC else [obj]
        for item in items:
            namespace, name = object_ref(item)
            for uid in list(self.volume_users.get((resource, namespace, name), ())):
                running = self.pods.get(uid)
                if running is None:
                    continue
                for volume in running.volumes:
                    if volume_ref(volume) == (resource, name):
                        self._write_volume(running, volume, source_files(volume, resource, item))
                    elif (resource, name) in podspec.projected_refs(volume):
                        known = {(resource, name): item}
                        self._materialize_volume(running.pod, running, volume, known)

    def _runnable(self, pod: JsonDict) -> bool:
        return podspec.is_runnable(
            pod, self.settings.runnable_image_substrings, self.settings.runnable_label
        )

    def _on_pod(self, pod: JsonDict) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid", "")
        if not self._runnable(pod):
            return
        if meta.get("deletionTimestamp"):
            self._terminate(pod)
            return
        running = self.pods.get(uid)
        if running is not None:
            running.pod = pod
            self._refresh_volumes(running, pod)
            self._reassert(running, pod)
            return
        status = pod.get("status") or {}
        if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
            return
        try:
            self._start_pod(pod)
        except (ApiError, OSError, ValueError) as err:
            log.exception(
                "cannot start pod %s/%s: %s", meta.get("namespace"), meta.get("name"), err
            )

    # ----- volumes ------------------------------------------------------------------
    def _fetch(self, namespace: str, resource: str, name: str) -> JsonDict:
        """The object, or ``{}`` when it does not exist."""
        try:
            return self.client.get(f"/api/v1/namespaces/{namespace}/{resource}/{name}")
        except ApiError as err:
            if err.status == 404:
                return {}
            raise

    def _fetch_map(self, namespace: str, resource: str, name: str) -> dict[str, str]:
        obj = self._fetch(namespace, resource, name)
        if resource == SECRETS:
            return {k: v.decode(errors="replace") for k, v in podspec.secret_data(obj).items()}
        return {k: str(v) for k, v in (obj.get("data") or {}).items()}

    def _token(self, running: RunningPod, pod: JsonDict, key: tuple[str, int],
               source: JsonDict) -> str:
        """The cached token of a serviceAccountToken source, or a new one when due."""
        cached = running.issued_tokens.get(key)
        if cached is not None and not cached.refresh_due(time.time()):
            return cached.token
        response = self.client.post(tokens.request_path(pod), tokens.token_request(pod, source))
        token = tokens.token_from_response(response)
        running.issued_tokens[key] = token
        log.info(
            "%s/%s: token for serviceaccount %s (volume %s), refresh in %.0f s",
            running.namespace, running.name, tokens.service_account(pod), key[0],
            token.refresh_at() - time.time(),
        )
        return token.token

    def _projected_files(
        self, running: RunningPod, pod: JsonDict, volume: JsonDict, known: Known = None
    ) -> dict[str, bytes]:
        """A projected volume's files; ``known`` objects (just seen by a watch) are not
        fetched again, and a token is only requested when there is none or it is due."""
        objects = dict(known or {})
        for resource, name in podspec.projected_refs(volume):
            if (resource, name) not in objects:
                objects[(resource, name)] = self._fetch(running.namespace, resource, name)
        found: dict[int, str] = {}
        for index, source in enumerate((volume.get("projected") or {}).get("sources") or []):
            if source.get(podspec.TOKEN_SOURCE):
                key = (str(volume["name"]), index)
                found[index] = self._token(running, pod, key, source[podspec.TOKEN_SOURCE])
        return podspec.projected_files(pod, volume, objects, found)

    def _volume_files(
        self, pod: JsonDict, volume: JsonDict, running: RunningPod | None = None,
        known: Known = None,
    ) -> dict[str, bytes] | None:
        if "downwardAPI" in volume:
            files = podspec.downward_api_files(pod, volume)
            return {k: v.encode() for k, v in files.items()}
        if "projected" in volume and running is not None:
            return self._projected_files(running, pod, volume, known)
        ref = volume_ref(volume)
        if ref is None:
            return None
        resource, name = ref
        obj = self._fetch(pod["metadata"]["namespace"], resource, name)
        return source_files(volume, resource, obj)

    @staticmethod
    def _write_volume(running: RunningPod, volume: JsonDict, files: dict[str, bytes]) -> None:
        vdir = running.directory / "volumes" / volume["name"]
        try:
            if volumes.write_volume(vdir, files):
                log.info(
                    "%s/%s: volume %s updated", running.namespace, running.name, volume["name"]
                )
        except (OSError, ValueError) as err:
            log.warning(
                "%s/%s: volume %s: %s", running.namespace, running.name, volume["name"], err
            )

    def _materialize_volume(
        self, pod: JsonDict, running: RunningPod, volume: JsonDict, known: Known = None
    ) -> bool:
        """Write one volume's files; a failed token request is kept in ``mount_errors``
        (a container that mounts the volume then fails to start with it) and the old
        files stay."""
        name = str(volume["name"])
        (running.directory / "volumes" / name).mkdir(parents=True, exist_ok=True)
        try:
            files = self._volume_files(pod, volume, running, known)
        except (ApiError, OSError, ValueError, KeyError) as err:
            if "projected" not in volume:
                raise
            running.mount_errors[name] = f"MountVolume.SetUp failed for volume {name!r}: {err}"
            log.warning("%s/%s: %s", running.namespace, running.name,
                        running.mount_errors[name])
            return False
        running.mount_errors.pop(name, None)
        if files is not None:
            self._write_volume(running, volume, files)
        return True

    def _materialize(self, pod: JsonDict, running: RunningPod, only_downward: bool) -> None:
        for volume in running.volumes:
            if only_downward and not self._has_downward(volume):
                continue
            self._materialize_volume(pod, running, volume)

    @staticmethod
    def _has_downward(volume: JsonDict) -> bool:
        sources = (volume.get("projected") or {}).get("sources") or []
        return "downwardAPI" in volume or any(s.get("downwardAPI") for s in sources)

    def _refresh_tokens(self, running: RunningPod) -> None:
        """Like the kubelet's token manager: a new token once 80% of the old one's lifetime
        has passed (failed attempts are retried every ``TOKEN_RETRY_S``)."""
        now = time.time()
        if not running.issued_tokens or time.monotonic() < running.token_retry_at:
            return
        due = {name for (name, _), token in running.issued_tokens.items() if token.refresh_due(now)}
        for volume in running.volumes:
            if volume["name"] in due and not self._materialize_volume(
                running.pod, running, volume
            ):
                running.token_retry_at = time.monotonic() + TOKEN_RETRY_S

    @staticmethod
    def _meta_digest(pod: JsonDict) -> str:
        meta = pod.get("metadata") or {}
        return repr(
            (
                sorted((meta.get("labels") or {}).items()),
                sorted((meta.get("annotations") or {}).items()),
            )
        )

    def _refresh_volumes(self, running: RunningPod, pod: JsonDict) -> None:
        """Downward-API files follow label and annotation changes."""
        digest = self._meta_digest(pod)
        if digest != running.meta_digest:
            running.meta_digest = digest
            self._materialize(pod, running, only_downward=True)

    # ----- processes ----------------------------------------------------------------
    def _start_pod(self, pod: JsonDict) -> None:
        meta = pod["metadata"]
        spec = pod.get("spec") or {}
        uid = meta["uid"]
        directory = self.paths.pods / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        running = RunningPod(
            uid=uid,
            namespace=meta["namespace"],
            name=meta["name"],
            pod_ip=pod["status"]["podIP"],
            directory=directory,
            containers=[
                ContainerProc(name=c["name"], image=c.get("image", ""), container=c)
                for c in spec.get("containers") or []
            ],
            restart_policy=spec.get("restartPolicy", "Always"),
            volumes=list(spec.get("volumes") or []),
            meta_digest=self._meta_digest(pod),
            pod=pod,
        )
        self._materialize(pod, running, only_downward=False)
        self.pods[uid] = running
        for volume in running.volumes:
            for resource, name in volume_refs(volume):
                self.volume_users.setdefault((resource, running.namespace, name), set()).add(uid)
        for cp in running.containers:
            self._start_container(running, pod, cp)
        self._report(running)
        log.info("started pod %s/%s on %s", running.namespace, running.name, running.pod_ip)

    def _rewrites(
        self, pod: JsonDict, running: RunningPod, container: JsonDict
    ) -> list[podspec.MountRewrite]:
        rewrites = []
        for mount in container.get("volumeMounts") or []:
            local = running.directory / "volumes" / mount["name"]
            if mount.get("subPath"):
                local = local / mount["subPath"]
            else:
                local.mkdir(parents=True, exist_ok=True)
            rewrites.append(podspec.MountRewrite(mount["mountPath"], str(local)))
        _link_nested_mounts(rewrites)
        return rewrites

    def _env_maps(self, pod: JsonDict, container: JsonDict) -> dict[str, dict[str, str]]:
        names = set()
        for source in container.get("envFrom") or []:
            if source.get("configMapRef"):
                names.add(source["configMapRef"].get("name", ""))
        for var in container.get("env") or []:
            ref = (var.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                names.add(ref.get("name", ""))
        ns = pod["metadata"]["namespace"]
        return {name: self._fetch_map(ns, CONFIGMAPS, name) for name in names if name}

    def service_env(self, pod: JsonDict) -> dict[str, str]:
        """The kubelet's Service variables for a container of ``pod``, as of now."""
        links = (pod.get("spec") or {}).get("enableServiceLinks", True) is not False
        namespace = str(pod["metadata"]["namespace"])
        env = services.pod_service_env(namespace, links, self.services.values())
        if not self._kubernetes_reachable():
            env.update(self._direct_apiserver_env())
        return env

    def _kubernetes_reachable(self) -> bool:
        """Whether the service proxy serves ``kubernetes`` on its ClusterIP:443 (it cannot
        bind port 443 without root or a lowered ``ip_unprivileged_port_start``)."""
        if not self._kubernetes_served:
            ip = self.settings.kubernetes_service_ip()
            self._kubernetes_served = procs.listening(ip, KUBERNETES_SERVICE_PORT)
        return self._kubernetes_served

    def _direct_apiserver_env(self) -> dict[str, str]:
        """``KUBERNETES_SERVICE_*`` pointing straight at the API server (its serving cert
        lists that address too): the fallback when the ClusterIP's port 443 is not served."""
        url = urllib.parse.urlsplit(self.client.server)
        direct = {
            "metadata": {"name": services.MASTER_SERVICE},
            "spec": {
                "clusterIP": url.hostname,
                "ports": [{"name": KUBERNETES_PORT_NAME, "port": url.port}],
            },
        }
        return services.service_env([direct])

    def mount_ns_error(self) -> str | None:
        """Why containers cannot get their own mount namespace here (None: they can).

        Checked once, by running the real thing: a bind onto the service-account path."""
        if self._mount_ns_checked:
            return self._mount_ns_error
        self._mount_ns_checked = True
        check = self.paths.root / "mount-ns-check"
        shutil.rmtree(check, ignore_errors=True)
        (check / "sa").mkdir(parents=True)
        (check / "sa" / "token").write_text("ok")
        target = f"{mountns.SERVICE_ACCOUNT_DIR}/token"
        argv = mountns.command(
            [(str(check / "sa"), mountns.SERVICE_ACCOUNT_DIR, True)],
            str(check / "stage"),
            ["cat", target],
            hostname="mount-ns-check",
        )
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
            output = (done.stdout + done.stderr).decode(errors="replace").strip()
            if done.returncode != 0 or done.stdout.decode() != "ok":
                self._mount_ns_error = f"{' '.join(argv[:6])} ... failed: {output[-500:]}"
        except (OSError, subprocess.TimeoutExpired) as err:
            self._mount_ns_error = f"cannot run {argv[0]!r}: {err}"
        if self._mount_ns_error:
            log.error("containers get no mount namespace: %s", self._mount_ns_error)
        shutil.rmtree(check, ignore_errors=True)
        return self._mount_ns_error

    def _binds(
        self, pod: JsonDict, running: RunningPod, cp: ContainerProc
    ) -> tuple[list[mountns.Bind], list[mountns.Bind]]:
        """(the volume mounts under ``BIND_MOUNT_ROOTS``, the managed ``/etc/hosts``)."""
        volume_binds: list[mountns.Bind] = []
        for mount in cp.container.get("volumeMounts") or []:
            if not is_bind_mount(str(mount["mountPath"])):
                continue
            local = running.directory / "volumes" / mount["name"]
            if mount.get("subPath"):
                local = local / mount["subPath"]
            read_only = bool(mount.get("readOnly"))
            volume_binds.append((str(local), str(mount["mountPath"]), read_only))
        hosts = running.directory / "hosts"
        tmp = hosts.with_suffix(".tmp")
        tmp.write_text(services.hosts_file(pod, self.services.values()))
        tmp.replace(hosts)
        return volume_binds, [(str(hosts), HOSTS_PATH, False)]

    def _cannot_start(self, running: RunningPod, cp: ContainerProc, message: str) -> None:
        """The container could not be set up: reported like an exit, restarted per policy."""
        cp.message = message
        log.warning("%s/%s container %s: %s", running.namespace, running.name, cp.name, message)
        self._exited(running, cp, NO_COMMAND_EXIT, keep_message=True)

    def _start_container(self, running: RunningPod, pod: JsonDict, cp: ContainerProc) -> None:
        container = cp.container
        implicit = self.service_env(pod)
        implicit.update(
            {
                "POD_IP": running.pod_ip,
                "POD_NAME": running.name,
                "POD_NAMESPACE": running.namespace,
                "NODE_NAME": str((pod.get("spec") or {}).get("nodeName", "")),
            }
        )
        rewrites = [
            rw for rw in self._rewrites(pod, running, container)
            if not is_bind_mount(rw.mount_path)
        ]
        entrypoint = podspec.image_entrypoint(cp.image, self.entrypoints)
        spec = podspec.process_spec(
            pod, container, implicit, rewrites, self._env_maps(pod, container), entrypoint
        )
        cp.started_at = _now()
        cp.finished_at = None
        cp.exit_code = None
        cp.readiness.restart()
        cp.probe_future = None
        cp.last_probe = 0.0
        cp.in_mount_ns = False
        if not spec.argv:
            cp.exit_code = NO_COMMAND_EXIT
            cp.finished_at = cp.started_at
            cp.message = (
                f"no command, and image {cp.image!r} matches no entry of image_entrypoints"
                f" ({sorted(self.entrypoints)}): nothing to run"
            )
            return
        # Like the kubelet, a volume that could not be set up keeps the container from
        # starting (retried at each restart).
        mounted = {m["name"] for m in container.get("volumeMounts") or []}
        for volume in running.volumes:
            if volume["name"] in mounted and volume["name"] in running.mount_errors:
                self._materialize_volume(pod, running, volume)
        errors = [running.mount_errors[n] for n in sorted(mounted) if n in running.mount_errors]
        if errors:
            self._cannot_start(running, cp, "; ".join(errors))
            return
        volume_binds, hosts_bind = self._binds(pod, running, cp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES)}
        python_dir = str(Path(sys.executable).parent)
        env["PATH"] = python_dir + os.pathsep + env.get("PATH", "")
        env.update(spec.env)
        env = bindpin.pinned_env(self.bind_pin, running.pod_ip, env)
        argv0 = shutil.which(spec.argv[0], path=env["PATH"]) or spec.argv[0]
        argv = [argv0, *spec.argv[1:]]
        ns_error = self.mount_ns_error()
        if ns_error is None:
            stage = running.directory / "mount-stage" / cp.name
            argv = mountns.command(
                [*volume_binds, *hosts_bind], str(stage), argv, hostname=services.pod_hostname(pod)
            )
            cp.in_mount_ns = True
        elif volume_binds:
            # Never fall back to something else: the pod asked for these files there.
            paths = ", ".join(target for _, target, _ in volume_binds)
            self._cannot_start(
                running, cp, f"cannot mount {paths}: no mount namespace ({ns_error})"
            )
            return
        log_path = running.directory / f"{cp.name}.log"
        name = f"{running.uid}-{cp.name}"
        try:
            cp.proc = procs.start(
                name,
                argv,
                log_path,
                self.paths.pod_pids,
                env=env,
                cwd=Path(spec.cwd) if spec.cwd else running.directory,
                marker=argv0,
            )
            cp.record = procs.PidRecord.read(self.paths.pod_pids / f"{name}{procs.PID_SUFFIX}")
            cp.message = ""
        except OSError as err:
            cp.exit_code = NO_COMMAND_EXIT
            cp.finished_at = cp.started_at
            cp.message = f"cannot start {spec.argv[0]!r}: {err}"

    def _stop_container(self, cp: ContainerProc, grace_s: float) -> None:
        if cp.record is not None:
            procs.stop_record(cp.record, self.paths.pod_pids, grace_s)
        if cp.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                cp.proc.wait(timeout=grace_s)
        cp.record = None

    def _stop_containers(self, running: RunningPod, why: str) -> None:
        for cp in running.containers:
            self._stop_container(cp, self.settings.stop_timeout_s)
        log.info("stopped pod %s/%s (%s)", running.namespace, running.name, why)

    def _terminate(self, pod: JsonDict) -> None:
        """A pod marked for deletion, as a kubelet ends it: stop its containers, then
        remove it (the final, zero-grace delete). Only then is its address free for
        another pod: kwok recycles an IP when the pod object goes."""
        uid = str(pod["metadata"]["uid"])
        if uid in self.finalizing:
            return
        self.finalizing.add(uid)
        running = self._forget_pod(uid)
        self.stopper.submit(self._stop_then_remove, running, pod)

    def _stop_then_remove(self, running: RunningPod | None, pod: JsonDict) -> None:
        if running is not None:
            self._stop_containers(running, "pod terminating")
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        final = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                 "preconditions": {"uid": meta["uid"]}}
        for _ in range(FINAL_DELETE_TRIES):
            if self.stopping.is_set():
                return
            try:
                self.client.request("DELETE", path, final)
                return
            except (ApiError, OSError) as err:
                # gone already, or another pod by that name now: nothing to remove
                if isinstance(err, ApiError) and err.status in (404, 409):
                    return
                log.warning("final delete of pod %s/%s: %s", meta["namespace"],
                            meta["name"], err)
            self.stopping.wait(RETRY_DELAY_S)
        self.events.put((PODS, RETRY_FINAL_DELETE, pod))  # the loop owns ``finalizing``

    def _forget_pod(self, uid: str) -> RunningPod | None:
        """Stop tracking a pod (its volumes' users too); its containers still run."""
        running = self.pods.pop(uid, None)
        if running is None:
            return None
        for volume in running.volumes:
            for resource, name in volume_refs(volume):
                users = self.volume_users.get((resource, running.namespace, name))
                if users is not None:
                    users.discard(uid)
                    if not users:
                        del self.volume_users[(resource, running.namespace, name)]
        return running

    def _stop_pod(self, uid: str, why: str) -> None:
        running = self._forget_pod(uid)
        if running is None:
            return
        # In the background: one container that ignores SIGTERM must not stall the loop.
        self.stopper.submit(self._stop_containers, running, why)

    # ----- probes and status --------------------------------------------------------
    def _probe(self, running: RunningPod, cp: ContainerProc) -> None:
        """Update ``cp.readiness`` from the last finished probe; start the next one when due."""
        probe = cp.container.get("readinessProbe")
        if not probe:
            cp.readiness.started_without_probe()
            return
        future = cp.probe_future
        if future is not None:
            if not future.done():
                return
            cp.probe_future = None
            cp.readiness.record(future.exception() is None and future.result(), probe)
        period = min(float(probe.get("periodSeconds", PROBE_INTERVAL_CAP_S)), PROBE_INTERVAL_CAP_S)
        if time.monotonic() - cp.last_probe >= period:
            cp.last_probe = time.monotonic()
            cp.probe_future = self.prober.submit(probe_once, running.pod_ip, cp.container, probe)

    def _container_status(self, cp: ContainerProc) -> JsonDict:
        status: JsonDict = {
            "name": cp.name,
            "image": cp.image,
            "imageID": "",
            "restartCount": cp.restart_count,
            "ready": cp.ready,
            "started": cp.exit_code is None and cp.started_at is not None,
        }
        if cp.exit_code is None:
            status["state"] = {"running": {"startedAt": cp.started_at}}
        elif cp.restart_at is not None:
            status["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": cp.message}}
        else:
            status["state"] = {"terminated": self._terminated(cp)}
        if cp.last_terminated is not None:
            status["lastState"] = {"terminated": cp.last_terminated}
        return status

    @staticmethod
    def _terminated(cp: ContainerProc) -> JsonDict:
        code = cp.exit_code or 0
        return {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "message": cp.message,
            "startedAt": cp.started_at,
            "finishedAt": cp.finished_at,
        }

    @staticmethod
    def _reassert(running: RunningPod, pod: JsonDict) -> None:
        """Like a kubelet, own the pod's Ready condition: when someone else changed it (the
        node lifecycle controller marks pods NotReady while a node's heartbeat lags), the
        next report writes the runner's view again."""
        conditions = (pod.get("status") or {}).get("conditions") or []
        seen = next((c.get("status") for c in conditions if c.get("type") == "Ready"), None)
        if running.last_status and seen is not None and seen != running.last_status.get("ready"):
            running.last_status = {}

    def _report(self, running: RunningPod) -> None:
        statuses = [self._container_status(cp) for cp in running.containers]
        all_ready = all(cp.ready for cp in running.containers)
        finished = all(
            cp.exit_code is not None and cp.restart_at is None for cp in running.containers
        )
        phase = "Running"
        if finished:
            failed = any((cp.exit_code or 0) != 0 for cp in running.containers)
            phase = "Failed" if failed else "Succeeded"
        ready = "True" if all_ready and not finished else "False"
        body: JsonDict = {
            "status": {
                "phase": phase,
                "containerStatuses": statuses,
                "conditions": [
                    {"type": "Ready", "status": ready},
                    {"type": "ContainersReady", "status": ready},
                ],
            }
        }
        key = repr(body)
        if key == running.last_status.get("key"):
            return
        now = _now()
        for cond in body["status"]["conditions"]:
            cond["lastTransitionTime"] = now
        try:
            self.client.patch(
                f"/api/v1/namespaces/{running.namespace}/pods/{running.name}/status",
                body,
                STRATEGIC_PATCH,
            )
            running.last_status = {"key": key, "ready": ready}
        except ApiError as err:
            if err.status == 404:
                self._stop_pod(running.uid, "pod gone")
            else:
                log.warning(
                    "status patch for %s/%s failed: %s", running.namespace, running.name, err
                )
        running.done = finished

    def tick(self) -> None:
        """One pass over the running pods: exits, restarts, probe results, status."""
        self.last_tick = time.monotonic()
        for running in list(self.pods.values()):
            if running.done:
                continue
            for cp in running.containers:
                if cp.restart_at is not None:
                    if time.monotonic() >= cp.restart_at:
                        cp.restart_at = None
                        cp.restart_count += 1
                        pod = self._get_pod(running)
                        if pod is None:
                            break
                        self._start_container(running, pod, cp)
                    continue
                if cp.proc is not None and cp.exit_code is None:
                    code = cp.proc.poll()
                    if code is not None:
                        self._exited(running, cp, code)
                        continue
                    self._probe(running, cp)
            if running.uid in self.pods:
                self._refresh_tokens(running)
                self._report(running)

    def _get_pod(self, running: RunningPod) -> JsonDict | None:
        try:
            return self.client.get(f"/api/v1/namespaces/{running.namespace}/pods/{running.name}")
        except ApiError:
            return None

    def _exited(
        self, running: RunningPod, cp: ContainerProc, code: int, keep_message: bool = False
    ) -> None:
        cp.exit_code = code if code >= 0 else 128 - code
        cp.finished_at = _now()
        if not keep_message:
            cp.message = ""
            if cp.in_mount_ns and code == mountns.MOUNT_FAILED_EXIT:
                cp.message = mount_error_message(running.directory / f"{cp.name}.log")
        cp.readiness.restart()
        cp.probe_future = None
        if cp.record is not None:
            # Like a container exit: whatever the main process left in its group goes too.
            self.stopper.submit(
                procs.stop_record, cp.record, self.paths.pod_pids, self.settings.stop_timeout_s
            )
            cp.record = None
        policy = running.restart_policy
        if policy == "Always" or (policy == "OnFailure" and cp.exit_code != 0):
            cp.last_terminated = self._terminated(cp)
            backoff = min(2.0**cp.restart_count, BACKOFF_MAX_S)
            cp.restart_at = time.monotonic() + backoff
        log.info(
            "%s/%s container %s exited with %s",
            running.namespace,
            running.name,
            cp.name,
            cp.exit_code,
        )

    # ----- main loop ----------------------------------------------------------------
    def run(self) -> None:
        for resource in (SERVICES, CONFIGMAPS, SECRETS):
            threading.Thread(
                target=self._watch, args=(resource,), name=f"{resource}-watch", daemon=True
            ).start()
        threading.Thread(target=self._watch_pods, name="pod-watch", daemon=True).start()
        while not self.stopping.is_set():
            wait_s = max(0.0, self.last_tick + TICK_S - time.monotonic())
            try:
                resource, kind, obj = self.events.get(timeout=wait_s)
                self.handle(resource, kind, obj)
                while True:
                    resource, kind, obj = self.events.get_nowait()
                    self.handle(resource, kind, obj)
            except queue.Empty:
                pass
            # At most one status pass per TICK_S however many events arrive.
            if time.monotonic() - self.last_tick >= TICK_S:
                self.tick()
        for uid in list(self.pods):
            self._stop_pod(uid, "runner stopping")
        self.stopper.shutdown(wait=True)
        self.prober.shutdown(wait=False, cancel_futures=True)


def main(state_dir: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    opened = open_state(state_dir, log.error)
    if opened is None:
        return 1
    settings, paths, info = opened
    runner = PodRunner(settings, paths, kube_client(paths, info.server))

    def _stop(signum: int, frame: object) -> None:
        runner.stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    runner.run()
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="local-cluster pod runner")
    parser.add_argument("--state-dir", required=True)
    sys.exit(main(Path(parser.parse_args().state_dir)))
