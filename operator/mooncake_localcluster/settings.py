"""One typed settings object for the local cluster (env prefix ``MOONCAKE_LOCALCLUSTER_``)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LOOPBACK_HOST = "127.0.0.1"
LOOPBACK_NET = ipaddress.IPv4Network("127.0.0.0/8")
# The apiserver refuses a service range wider than /12 (20 host bits).
MIN_SERVICE_PREFIX = 12
# Clusters running side by side on one host each take a network slot k: pods in
# 127.(POD_SLOT_BASE+k).N.0/24, Services in 127.(SERVICE_SLOT_BASE+k).0.0/16.
NETWORK_SLOTS = 16
POD_SLOT_BASE = 1
SERVICE_SLOT_BASE = 96


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/mooncake-operator/localcluster`` (or ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mooncake-operator" / "localcluster"


class NodePoolSettings(BaseSettings):
    """Shape of one fake GPU node."""

    model_config = SettingsConfigDict(env_prefix="MOONCAKE_LOCALCLUSTER_NODE_")

    gpus: int = Field(default=8, ge=0, description="nvidia.com/gpu capacity per node")
    cpu: str = "192"
    memory: str = "2048Gi"
    pods: int = Field(default=110, ge=1)
    ephemeral_storage: str = "4Ti"
    instance_type: str = "p5.48xlarge"
    cpu_instance_type: str = "m7i.8xlarge"
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"


class LocalClusterSettings(BaseSettings):
    """Everything ``local-cluster`` needs: where things live, how many nodes, timeouts."""

    model_config = SettingsConfigDict(env_prefix="MOONCAKE_LOCALCLUSTER_")

    name: str = Field(default="default", pattern=r"^[a-z0-9][a-z0-9-]*$")
    cache_root: Path = Field(default_factory=default_cache_root)
    state_dir: Path | None = Field(
        default=None, description="defaults to <cache_root>/state/<name>"
    )
    tools_dir: Path | None = Field(
        default=None, description="the Go wrapper modules; defaults to <repo>/tools/localcluster"
    )
    go: str = "go"
    host: str = LOOPBACK_HOST

    prefill_nodes: int = Field(default=4, ge=0)
    decode_nodes: int = Field(default=4, ge=0)
    cpu_nodes: int = Field(
        default=1, ge=0, description="untainted nodes without GPUs, for the operator and gateway"
    )
    node: NodePoolSettings = Field(default_factory=NodePoolSettings)
    network_slot: int | None = Field(
        default=None,
        ge=0,
        lt=NETWORK_SLOTS,
        description=(
            "k: pods in 127.(1+k).N.0/24, Services in 127.(96+k).0.0/16; `up` takes the first"
            " slot no other running local cluster on this host holds (a restart keeps its own)"
        ),
    )
    pod_cidr_prefix: str | None = Field(
        default=None,
        pattern=r"^127\.\d{1,3}$",
        description="overrides the slot's: node N gets <prefix>.<N+1>.0/24 (must stay in 127/8)",
    )
    service_cidr: str | None = Field(
        default=None,
        description=(
            "overrides the slot's ClusterIP range (--service-cluster-ip-range): inside 127/8,"
            " /12 or smaller; the service proxy listens on each ClusterIP:port and the first"
            " address is the `kubernetes` Service"
        ),
    )
    image_entrypoints: dict[str, list[str]] = Field(
        default_factory=lambda: {"mooncake-operator": ["mooncake-operator"]},
        description=(
            "image-name substring -> the image's ENTRYPOINT argv; a container without"
            " `command` runs entrypoint + args (the longest matching substring wins); added"
            " to the entries read from images_dir's Dockerfiles, replacing one of the same name"
        ),
    )
    images_dir: Path | None = Field(
        default=None,
        description=(
            "where images/<dir>/Dockerfile build ghcr.io/mooncake-operator/<dir>: their last"
            " ENTRYPOINT joins image_entrypoints; defaults to the repository's images/"
        ),
    )

    ready_timeout_s: float = Field(default=90.0, gt=0)
    node_monitor_grace_s: int = Field(
        default=90, gt=0, description="kube-controller-manager's --node-monitor-grace-period: "
        "how long a fake node's missing heartbeat is tolerated before it is NotReady")
    stop_timeout_s: float = Field(default=10.0, gt=0)
    poll_interval_s: float = Field(default=0.2, gt=0)
    probe_workers: int = Field(
        default=16, ge=1, description="pod runner threads for readiness probes and pod stops"
    )
    proxy_connect_timeout_s: float = Field(
        default=2.0, gt=0, description="service proxy: connecting to one backend pod"
    )

    runnable_image_substrings: tuple[str, ...] = ("mooncake-operator",)
    runnable_label: str = "mooncake.io/runnable"
    kwok_node_annotation: str = "kwok.x-k8s.io/node"
    kwok_node_annotation_value: str = "fake"
    gpu_resource: str = "nvidia.com/gpu"
    pool_label: str = "mooncake.io/pool"

    @field_validator("service_cidr")
    @classmethod
    def _loopback_service_range(cls, value: str | None) -> str | None:
        if value is None:
            return None
        net = ipaddress.IPv4Network(value, strict=True)
        if not net.subnet_of(LOOPBACK_NET):
            raise ValueError(f"service_cidr {value} must lie inside {LOOPBACK_NET}")
        if net.prefixlen < MIN_SERVICE_PREFIX:
            raise ValueError(f"service_cidr {value} is wider than /{MIN_SERVICE_PREFIX}")
        return value

    def pod_prefix(self) -> str:
        """``127.X``: node N's pods are in ``127.X.<N+1>.0/24`` (slot 0 when unresolved)."""
        return self.pod_cidr_prefix or f"127.{POD_SLOT_BASE + (self.network_slot or 0)}"

    def service_range(self) -> str:
        """The ClusterIP range (slot 0 when unresolved)."""
        slot = self.network_slot or 0
        return self.service_cidr or f"127.{SERVICE_SLOT_BASE + slot}.0.0/16"

    def kubernetes_service_ip(self) -> str:
        """The first address of the service range: the ``kubernetes`` Service's ClusterIP."""
        return str(ipaddress.IPv4Network(self.service_range())[1])

    def with_slot(self, slot: int) -> LocalClusterSettings:
        """These settings with the network slot (and the ranges it implies) fixed."""
        return self.model_copy(
            update={
                "network_slot": slot,
                "pod_cidr_prefix": self.pod_cidr_prefix or f"127.{POD_SLOT_BASE + slot}",
                "service_cidr": self.service_cidr or f"127.{SERVICE_SLOT_BASE + slot}.0.0/16",
            }
        )

    def resolved_state_dir(self) -> Path:
        return self.state_dir or self.cache_root / "state" / self.name

    def binary_dir(self, component: str, version: str) -> Path:
        return self.cache_root / f"{component}-{version}"
