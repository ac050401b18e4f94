"""The operator process's one settings object (env prefix ``MOONCAKE_OPERATOR_``).

Everything the operator does not read from a MooncakeCluster lives here with its default
and meaning: which image runs our worker and the store, where the gateway is, how often to
reconcile, the names kopf uses for its own bookkeeping.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from . import __version__

#: The worker image (``images/worker/``) of this release: the ``mooncake-operator`` CLI as
#: ENTRYPOINT, the worker (simulated engine, relay and agent beside real engines), the store
#: node, and Mooncake Store's ``mooncake_master`` from its PyPI wheel. The operator and the
#: gateway run from the operator image (``ghcr.io/mooncake-operator/operator``).
DEFAULT_IMAGE = f"ghcr.io/mooncake-operator/worker:{__version__}"


class OperatorSettings(BaseSettings):
    """Settings of one operator process."""

    model_config = SettingsConfigDict(env_prefix="MOONCAKE_OPERATOR_", frozen=True,
                                      extra="forbid")

    image: str = Field(DEFAULT_IMAGE, description=(
        "image of the simulated engine, the worker sidecar beside real engines and the "
        "store (unless a MooncakeCluster names its own)"))
    image_pull_policy: str = Field("IfNotPresent", description="pull policy of that image")
    gateway_url: str = Field("http://127.0.0.1:8080", description=(
        "where the operator reads the gateway's registry and hot prefixes (the sidecar)"))
    gateway_public_url: str = Field("", description=(
        "the gateway's address as users reach it, written into status (default: "
        "gateway_url)"))
    gateway_timeout_s: float = Field(2.0, gt=0, description="timeout of one gateway call")
    gateway_namespace: str = Field("", description=(
        "the namespace of the gateway's pods (the chart: the operator's own); with "
        "gateway_pod_labels, what each cluster's NetworkPolicy admits"))
    gateway_pod_labels: dict[str, str] = Field(default_factory=dict, description=(
        "labels that select the gateway's pods (JSON in the environment); empty: the "
        "operator makes no NetworkPolicy, as it cannot tell the gateway's traffic apart"))
    gateway_admin_keys_dir: Path | None = Field(None, description=(
        "the gateway's admin keys (a mounted Secret, one file per key): the operator sends "
        "the first, by file name, to /conductor/*, read again on every call so a rotated "
        "key is used at once (None: the gateway asks for none)"))
    resync_interval_s: float = Field(10.0, gt=0, description=(
        "reconcile every cluster at least this often (level-based: status follows the pods "
        "even without events)"))
    busy_interval_s: float = Field(1.0, gt=0, description=(
        "reconcile this often while a cluster is progressing (creating, rolling, draining)"))
    event_debounce_s: float = Field(0.2, ge=0, description=(
        "wait this long after a pod event before reconciling, to batch bursts"))
    index_audit_interval_s: float = Field(300.0, gt=0, description=(
        "check each cluster's kopf indexes against a list from the API this often: kopf "
        "keeps an object deleted while its watch was down and had to list again, and the "
        "audit hides it (cache.py)"))
    max_parallel_writes: int = Field(16, ge=1, description=(
        "pod creations in flight at once (a 32+32 cluster is made in a few round trips, "
        "not 64 in a row)"))
    leader_election: bool = Field(True, description=(
        "run only while holding the leader Lease (leader.py): several replicas, one writer"))
    lease_name: str = Field("mooncake-operator", description="the leader Lease's name")
    lease_namespace: str = Field("", description=(
        "the leader Lease's namespace (the chart: the release namespace); empty: the "
        "pod's own (POD_NAMESPACE), else default"))
    identity: str = Field("", description=(
        "this replica's name in the Lease (empty: POD_NAME, else host name and process id)"))
    lease_duration_s: float = Field(15.0, gt=0, description=(
        "how long a Lease not renewed stays another replica's (client-go's default)"))
    renew_deadline_s: float = Field(10.0, gt=0, description=(
        "a leader that has not renewed for this long stops writing (client-go's default)"))
    lease_retry_s: float = Field(2.0, gt=0, description=(
        "how often each replica tries to acquire or renew (client-go's default)"))
    crash_loop_restarts: int = Field(3, ge=1, description=(
        "an engine pod that crashed this often within crash_loop_window_s is reported as "
        "crash-looping (Degraded); crashes.py"))
    crash_loop_window_s: float = Field(600.0, gt=0, description=(
        "the window crashes are counted over: the kubelet forgets a container's crashes "
        "once it has run 10 minutes without one"))
    annotations_mount: str = Field("/etc/mooncake/podinfo", description=(
        "where engine pods mount their downward-API files (annotations, labels)"))
    gpu_resource: str = Field("nvidia.com/gpu", description="extended resource of a GPU")
    gpu_taint_key: str = Field("nvidia.com/gpu", description=(
        "taint key of GPU nodes; engine and store pods tolerate it"))
    gpu_node_label: str = Field("nvidia.com/gpu.present", description=(
        "label of GPU nodes (the store DaemonSet's default node selector uses it)"))
    store_buffer_bytes: int = Field(16 << 20, gt=0, description=(
        "local transfer buffer of each store-node client"))
    finalizer: str = Field("operator.mooncake.io/finalizer", description=(
        "finalizer kopf puts on MooncakeClusters (it stops the cluster's tasks first)"))
    annotation_prefix: str = Field("operator.mooncake.io", description=(
        "prefix of kopf's own bookkeeping annotations"))
    field_manager: str = Field("mooncake-operator", description="field manager of writes")
    metrics_host: str = Field("127.0.0.1", description="Prometheus metrics bind address")
    metrics_port: int = Field(9095, ge=0, le=65535, description=(
        "Prometheus metrics port (0: no metrics server)"))
    health_port: int = Field(0, ge=0, le=65535, description=(
        "kopf liveness endpoint port (0: none)"))
