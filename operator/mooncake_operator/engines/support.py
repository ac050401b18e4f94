"""The real-engine releases the operator generates pods for, and what each one supports.

A row here is a promise: ``tests/conformance`` installs that release from PyPI and checks
every pod the builders make for it against the engine's own parsers, config loaders,
connectors, KV-event publisher and metric definitions (``docs/real-cluster.md`` has the
table and the command). Manifests follow the release: the version comes from
``spec.engine.version``, else from the image tag (``vllm/vllm-openai:v0.33.0``,
``lmsysorg/sglang:v0.5.23-cu130``). A spec naming a release or a combination that is not
here is not guessed at: the cluster ends ``Degraded`` with the reason
``UnsupportedEngine`` and the children are left as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from ..spec import EngineKind, EngineSpec, MooncakeClusterSpec, StoreProtocol


class Handshake(StrEnum):
    """How the gateway hands a prefill's KV cache to the decode engine (the gateway's
    ``mooncake_gateway.handshake`` implements each by this name)."""

    #: vLLM's MooncakeConnector (P2P): the prefill gets ``kv_transfer_params``
    #: ``{do_remote_decode, transfer_id}``, the decode ``{do_remote_prefill,
    #: remote_engine_id, remote_bootstrap_addr, transfer_id}``; one after the other
    KV_TRANSFER_PARAMS = "kv-transfer-params"
    #: vLLM's MooncakeStoreConnector: no parameters; the decode engine finds the prompt's
    #: blocks in the store by their hashes
    STORE = "store"
    #: SGLang: both halves get ``bootstrap_host/port/room`` and are sent at once (the
    #: prefill waits for the decode engine to connect)
    BOOTSTRAP = "bootstrap"


@dataclass(frozen=True, slots=True)
class EngineRelease:
    """One engine version and the combinations its pods are generated (and proven) for."""

    kind: EngineKind
    version: str
    #: KV block (page) sizes in tokens the engine accepts for ``model.blockSize``
    block_sizes: frozenset[int]
    #: Mooncake transfer protocols, without and with a Mooncake Store
    protocols: frozenset[StoreProtocol]
    store_protocols: frozenset[StoreProtocol]
    #: the KV connector (vLLM) or transfer backend (SGLang) without and with a store
    p2p_connector: str
    store_connector: str
    #: the port the prefill engine's Mooncake bootstrap server listens on
    bootstrap_port: int

    @property
    def name(self) -> str:
        return f"{self.kind.value} {self.version}"

    def handshake(self, store: bool) -> Handshake:
        if self.kind is EngineKind.SGLANG:
            return Handshake.BOOTSTRAP
        return Handshake.STORE if store else Handshake.KV_TRANSFER_PARAMS


_BOTH = frozenset({StoreProtocol.TCP, StoreProtocol.RDMA})
#: Both engines' parsers take any positive block (page) size; their GPU attention kernels
#: (FlashAttention, FlashInfer) want multiples of 16, which no CPU can check. These are the
#: sizes the conformance suite builds each engine's cache configuration with.
_BLOCK_SIZES = frozenset({16, 32, 64, 128, 256})
#: every release the conformance suite installs and checks (newest last)
RELEASES: tuple[EngineRelease, ...] = (
    EngineRelease(
        kind=EngineKind.VLLM, version="0.33.0",
        block_sizes=_BLOCK_SIZES,
        protocols=_BOTH, store_protocols=_BOTH,
        p2p_connector="MooncakeConnector", store_connector="MooncakeStoreConnector",
        bootstrap_port=8998),
    EngineRelease(
        kind=EngineKind.SGLANG, version="0.5.23",
        block_sizes=_BLOCK_SIZES,
        protocols=_BOTH, store_protocols=_BOTH,
        p2p_connector="mooncake", store_connector="mooncake",
        bootstrap_port=8998),
)

#: ``v0.33.0``, ``0.5.23``, ``v0.5.23-cu130``, ``0.6.0rc1`` (a suffix after ``-`` is the
#: build variant, not the version)
_TAG_VERSION = re.compile(r"^v?(\d+\.\d+\.\d+(?:(?:\.post|rc|\.dev)\d+)?)(?:[-+_].*)?$")


class UnsupportedEngine(ValueError):
    """The spec asks for an engine release or combination the operator does not generate."""


def image_version(image: str) -> str | None:
    """The release an image's tag names, or None (no tag, ``latest``, a digest only)."""
    ref = image.split("@", 1)[0]
    name = ref.rsplit("/", 1)[-1]
    if ":" not in name:
        return None
    m = _TAG_VERSION.match(name.rsplit(":", 1)[1])
    return m.group(1) if m else None


def engine_version(engine: EngineSpec) -> str | None:
    """``spec.engine.version``, else the version in the image tag."""
    if engine.version:
        return engine.version
    return image_version(engine.image) if engine.image else None


def releases(kind: EngineKind) -> list[EngineRelease]:
    return [r for r in RELEASES if r.kind is kind]


def release_of(spec: MooncakeClusterSpec) -> EngineRelease:
    """The release this spec's real engine is, checked against the combinations it
    supports; raises :class:`UnsupportedEngine` with a message a user can act on."""
    kind = spec.engine.kind
    known = releases(kind)
    tested = ", ".join(r.version for r in known)
    version = engine_version(spec.engine)
    if version is None:
        raise UnsupportedEngine(
            f"spec.engine: cannot tell which {kind.value} release image "
            f"{spec.engine.image!r} is; set spec.engine.version (supported: {tested})")
    release = next((r for r in known if r.version == version), None)
    if release is None:
        raise UnsupportedEngine(f"spec.engine.version: {kind.value} {version} is not a "
                                f"supported release (supported: {tested})")
    store = spec.store.enabled
    protocols = release.store_protocols if store else release.protocols
    if spec.store.protocol not in protocols:
        where = "with" if store else "without"
        raise UnsupportedEngine(f"spec.store.protocol: {release.name} does not transfer KV "
                                f"over {spec.store.protocol.value} {where} a store")
    if spec.model.block_size not in release.block_sizes:
        sizes = ", ".join(str(s) for s in sorted(release.block_sizes))
        raise UnsupportedEngine(f"spec.model.blockSize: {release.name} takes block sizes "
                                f"{sizes}, not {spec.model.block_size}")
    return release
