"""The combinations the conformance suite checks, per supported engine release.

For each release: store on and off, over TCP and RDMA, both roles; every block size the
release supports and every tensor-parallel size a pool asks for (1, 2, 4, 8). Each case
is the engine's example cluster with those fields changed, built by the operator's own
builders and staged as the kubelet would start it (``mooncake_conformance.pods``).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_conformance.envs import EngineEnv
from mooncake_conformance.pods import POD_IP, Staged, stage
from mooncake_conformance.settings import EngineEnvSettings
from mooncake_operator import builders
from mooncake_operator.engines import RELEASES, EngineRelease
from mooncake_operator.names import ClusterRef
from mooncake_operator.spec import MooncakeClusterSpec

from ..operator.manifests import SETTINGS, example, with_updates

ROLES = ("prefill", "decode")
PROTOCOLS = ("tcp", "rdma")
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Case:
    """One engine pod of one combination, as generated and staged."""

    release: EngineRelease
    store: bool
    protocol: str
    block_size: int
    tp: int
    role: str

    @property
    def id(self) -> str:
        store = "store" if self.store else "p2p"
        return (f"{self.release.kind.value}-{self.release.version}-{store}-{self.protocol}-"
                f"bs{self.block_size}-tp{self.tp}-{self.role}")

    def spec(self) -> tuple[ClusterRef, MooncakeClusterSpec]:
        ref, spec = example(self.release.kind.value)
        gpus = {"gpusPerReplica": self.tp}
        return ref, with_updates(
            spec, engine__version=self.release.version, store__enabled=self.store,
            store__protocol=self.protocol, model__blockSize=self.block_size,
            prefill__gpusPerReplica=gpus["gpusPerReplica"],
            decode__gpusPerReplica=gpus["gpusPerReplica"])

    def build(self) -> Built:
        ref, spec = self.spec()
        rev = builders.revision(ref, spec, SETTINGS)
        pod = builders.engine_pod(ref, spec, SETTINGS, self.role, rev, 0)
        children = builders.children(ref, spec, SETTINGS)
        root = Path(tempfile.mkdtemp(prefix="conformance-"))
        return Built(self, ref, spec, pod, children, stage(pod, children, root),
                     stage(pod, children, root, container="worker"))


@dataclass(frozen=True)
class Built:
    case: Case
    ref: ClusterRef
    spec: MooncakeClusterSpec
    pod: dict[str, Any]
    children: list[dict[str, Any]]
    engine: Staged
    worker: Staged

    def container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.pod["spec"]["containers"] if c["name"] == name)

    @property
    def pod_ip(self) -> str:
        return POD_IP


def cases(release: EngineRelease) -> list[Case]:
    """Store on/off x TCP/RDMA x both roles at the example's block size and TP size, then
    each other block size and TP size once (store on, TCP, both roles)."""
    _, spec = example(release.kind.value)
    bs, tp = spec.model.block_size, spec.prefill.gpus_per_replica
    out = [Case(release, store, proto, bs, tp, role)
           for store in (True, False) for proto in PROTOCOLS for role in ROLES]
    out += [Case(release, True, "tcp", b, tp, role)
            for b in sorted(release.block_sizes) if b != bs for role in ROLES]
    out += [Case(release, True, "tcp", bs, t, role) for t in TP_SIZES if t != tp
            for role in ROLES]
    return out


def env_of(release: EngineRelease) -> EngineEnv:
    return EngineEnv(release.kind.value, release.version, EngineEnvSettings())


RELEASE_IDS = {f"{r.kind.value}-{r.version}": r for r in RELEASES}
