"""Pure Service logic shared by the pod runner and the service proxy.

- :func:`service_env`: the kubelet's Docker-links style variables for a set of Services
  (``pkg/kubelet/envvars``), and :func:`pod_service_env`, which picks the Services a
  pod sees (its namespace when service links are on, plus ``default/kubernetes``).
- :func:`backends`: what kube-proxy would route one Service port to: the ready pods that
  match the selector, at the resolved ``targetPort``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

JsonDict = dict[str, Any]

TCP = "TCP"
HEADLESS = "None"
DEFAULT_NAMESPACE = "default"
MASTER_SERVICE = "kubernetes"  # the kubelet always adds this one from `default`
LOOPBACK_NET = ipaddress.IPv4Network("127.0.0.0/8")


def is_loopback(ip: str) -> bool:
    """Whether ``ip`` is an IPv4 address in 127/8 (the only place traffic may go here)."""
    try:
        return ipaddress.IPv4Address(ip) in LOOPBACK_NET
    except ValueError:
        return False


def cluster_ip(service: JsonDict) -> str | None:
    """The ClusterIP, or None for headless Services and those without one (ExternalName)."""
    ip = str((service.get("spec") or {}).get("clusterIP") or "")
    return None if ip in ("", HEADLESS) else ip


def env_name(name: str) -> str:
    """``my-svc`` -> ``MY_SVC`` (the kubelet's makeEnvVariableName)."""
    return name.replace("-", "_").upper()


def service_env(services: Iterable[JsonDict]) -> dict[str, str]:
    """The variables the kubelet derives from ``services`` (each must have a ClusterIP).

    Per Service ``NAME``: ``NAME_SERVICE_HOST``, ``NAME_SERVICE_PORT`` (the first port),
    ``NAME_SERVICE_PORT_<PORTNAME>`` per named port, ``NAME_PORT=<proto>://ip:port`` (first
    port), and per port ``NAME_PORT_<port>_<PROTO>`` with ``_PROTO``, ``_PORT``, ``_ADDR``.
    """
    env: dict[str, str] = {}
    for service in services:
        ip = cluster_ip(service)
        ports = (service.get("spec") or {}).get("ports") or []
        if ip is None or not ports:
            continue
        prefix = env_name(str(service["metadata"]["name"]))
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(int(ports[0]["port"]))
        for port in ports:
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{env_name(port['name'])}"] = str(int(port["port"]))
        for index, port in enumerate(ports):
            protocol = str(port.get("protocol") or TCP)
            number = int(port["port"])
            host = f"[{ip}]" if ":" in ip else ip  # Go's net.JoinHostPort
            url = f"{protocol.lower()}://{host}:{number}"
            if index == 0:
                env[f"{prefix}_PORT"] = url
            port_prefix = f"{prefix}_PORT_{number}_{protocol.upper()}"
            env[port_prefix] = url
            env[f"{port_prefix}_PROTO"] = protocol.lower()
            env[f"{port_prefix}_PORT"] = str(number)
            env[f"{port_prefix}_ADDR"] = ip
    return env


def pod_service_env(
    namespace: str, enable_service_links: bool, services: Iterable[JsonDict]
) -> dict[str, str]:
    """What the kubelet puts in a container of a pod in ``namespace``.

    ``default/kubernetes`` always; every other Service with a ClusterIP in the pod's
    namespace when ``spec.enableServiceLinks`` is not false (a ``kubernetes`` Service of the
    pod's own namespace then wins over the default one, as in the kubelet).
    """
    chosen: dict[str, JsonDict] = {}
    for service in services:
        if cluster_ip(service) is None:
            continue
        meta = service.get("metadata") or {}
        name = str(meta.get("name", ""))
        ns = meta.get("namespace")
        if ns == DEFAULT_NAMESPACE and name == MASTER_SERVICE:
            chosen.setdefault(name, service)
        elif ns == namespace and enable_service_links:
            chosen[name] = service
    return service_env(chosen.values())


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """A Service selector (equality on every key) against pod labels; empty matches none."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class PodView:
    """The part of a pod the service proxy routes by."""

    namespace: str
    name: str
    labels: Mapping[str, str]
    ip: str
    ready: bool
    named_ports: Mapping[str, int]  # TCP container ports by name


def pod_view(pod: JsonDict) -> PodView:
    """Ready means: condition Ready True, not terminating, a loopback pod IP."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    ip = str(status.get("podIP") or "")
    ready = (
        conditions.get("Ready") == "True" and not meta.get("deletionTimestamp") and is_loopback(ip)
    )
    named: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") and str(port.get("protocol") or TCP) == TCP:
                named.setdefault(str(port["name"]), int(port["containerPort"]))
    return PodView(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        labels=dict(meta.get("labels") or {}),
        ip=ip,
        ready=ready,
        named_ports=named,
    )


def target_port(service_port: JsonDict, pod: PodView) -> int | None:
    """``targetPort`` for ``pod``: a number, a named container port, or (unset) the port."""
    target = service_port.get("targetPort")
    if target is None or target == "":
        return int(service_port["port"])
    if isinstance(target, int):
        return target
    return pod.named_ports.get(str(target))


def backends(
    service: JsonDict, service_port: JsonDict, pods: Iterable[PodView]
) -> list[tuple[str, int]]:
    """(pod IP, port) of every ready pod behind one Service port, in a stable order."""
    meta = service.get("metadata") or {}
    namespace = meta.get("namespace")
    selector = (service.get("spec") or {}).get("selector") or {}
    found = []
    for pod in pods:
        if pod.namespace != namespace or not pod.ready:
            continue
        if not selector_matches(selector, pod.labels):
            continue
        port = target_port(service_port, pod)
        if port is not None:
            found.append((pod.ip, port))
    return sorted(found)


def tcp_ports(service: JsonDict) -> list[JsonDict]:
    """The Service's TCP ports (the only protocol the proxy forwards)."""
    ports = (service.get("spec") or {}).get("ports") or []
    return [p for p in ports if str(p.get("protocol") or TCP) == TCP]


def proxied(service: JsonDict) -> bool:
    """A Service the proxy serves: a loopback ClusterIP and a selector."""
    ip = cluster_ip(service)
    selector = (service.get("spec") or {}).get("selector") or {}
    return ip is not None and is_loopback(ip) and bool(selector)


def is_master(service: JsonDict) -> bool:
    meta = service.get("metadata") or {}
    return meta.get("namespace") == DEFAULT_NAMESPACE and meta.get("name") == MASTER_SERVICE


HOSTS_HEADER = """# Kubernetes-managed hosts file.
127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
fe00::0\tip6-mcastprefix
fe00::1\tip6-allnodes
fe00::2\tip6-allrouters
"""
CLUSTER_DOMAIN = "cluster.local"


def service_hostnames(service: JsonDict, pod_namespace: str) -> list[str]:
    """The names cluster DNS (with a pod's search path) would resolve to the ClusterIP."""
    meta = service.get("metadata") or {}
    name, ns = str(meta.get("name", "")), str(meta.get("namespace", ""))
    names = [f"{name}.{ns}.svc.{CLUSTER_DOMAIN}", f"{name}.{ns}.svc", f"{name}.{ns}"]
    if ns == pod_namespace:
        names.append(name)
    return names


MAX_HOSTNAME = 63


def pod_hostname(pod: JsonDict) -> str:
    """The kubelet's hostname for a pod: ``spec.hostname``, else the pod name cut to 63
    characters with trailing ``-`` and ``.`` removed."""
    spec = pod.get("spec") or {}
    if spec.get("hostname"):
        return str(spec["hostname"])
    name = str((pod.get("metadata") or {}).get("name", ""))
    return name[:MAX_HOSTNAME].rstrip("-.")


def hosts_file(pod: JsonDict, services: Iterable[JsonDict]) -> str:
    """``/etc/hosts`` for a container of ``pod``: the kubelet's managed file (localhost,
    the pod's IP and hostname (:func:`pod_hostname`), ``hostAliases``), then, since
    there is no cluster DNS, one line per Service with a ClusterIP (every namespace) with
    its DNS names."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    lines = [HOSTS_HEADER.rstrip("\n")]
    ip = str((pod.get("status") or {}).get("podIP") or "")
    hostname = pod_hostname(pod)
    if ip and hostname:
        names = [hostname]
        if spec.get("subdomain"):
            ns = meta.get("namespace", "")
            names.insert(0, f"{hostname}.{spec['subdomain']}.{ns}.svc.{CLUSTER_DOMAIN}")
        lines.append(ip + "\t" + "\t".join(names))
    aliases = spec.get("hostAliases") or []
    if aliases:
        lines += ["", "# Entries added by HostAliases."]
        for alias in aliases:
            lines.append(str(alias.get("ip", "")) + "\t" + "\t".join(alias.get("hostnames") or []))
    namespace = str(meta.get("namespace", ""))
    entries = []
    for service in services:
        cip = cluster_ip(service)
        if cip is not None:
            entries.append(cip + "\t" + "\t".join(service_hostnames(service, namespace)))
    if entries:
        lines += ["", "# Services (no cluster DNS here): the ones that existed at container start."]
        lines += sorted(entries)
    return "\n".join(lines) + "\n"
