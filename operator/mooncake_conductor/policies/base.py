"""The one small interface every prefill policy implements, and its registry's storage.

A policy is a class with a ``name``, a pydantic ``Params`` model (its knobs and
weights, with the published defaults) and ``pick(request, cluster, live, now) ->
Placement``. Each lives in its own module whose docstring states its rule and its
source, and registers itself with :func:`register`; policies are looked up and created
by name through :mod:`.registry` (:func:`~.registry.create_policy`), which imports
every policy module.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ..candidates import CandidatesConfig
from ..capabilities import Capabilities
from ..cost import CostModel
from ..index import PrefixIndex
from ..state import ClusterState, PrefillState, RequestInfo
from ..topology import Topology, TopologyConfig


class SLOConfig(BaseModel):
    """Service-level objectives (paper §5: TTFT 30 s; TBT 100/200/300 ms)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_s: float = Field(30.0, gt=0)
    tbt_s: float = Field(0.1, gt=0)


@dataclass(slots=True)
class Placement:
    """Where a request's prefill goes and what it is predicted to cost.

    ``local_blocks`` are reused from the chosen instance's own cache;
    ``fetch_blocks`` more are fetched from ``source`` (another instance or the
    store pool) instead of being recomputed.
    """

    prefill: int | None
    local_blocks: int = 0
    fetch_blocks: int = 0
    source: int | None = None
    queue_s: float = 0.0
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    priority: float | None = None
    reject_reason: str | None = None
    cpp_group: list[int] = field(default_factory=list)
    cpp_chunk_tokens: int = 0
    #: after a fetch, the source's copy goes to the cold end of its LRU (migration)
    migrate: bool = False
    candidates: list[dict[str, float | int]] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s

    @property
    def gpu_seconds(self) -> float:
        """Prefill node-seconds this placement uses (every CPP member for the makespan)."""
        return self.prefill_s * max(1, len(self.cpp_group))

    @property
    def reused_blocks(self) -> int:
        return self.local_blocks + self.fetch_blocks


@dataclass(slots=True)
class PolicyContext:
    """Shared, read-only things a policy may use."""

    cost: CostModel
    slo: SLOConfig
    rng: random.Random
    #: may a placement fetch a prefix from another instance or the store (else: local only)
    fetch: bool = True
    #: may a placement run on a CPP group of instances
    cpp: bool = True
    #: when decisions on large pools price candidates only (:mod:`..candidates`)
    candidates: CandidatesConfig = field(default_factory=CandidatesConfig)
    #: the fleet's places and links (default: a flat fleet)
    topology: Topology = field(default_factory=lambda: Topology(TopologyConfig()))


class PrefillPolicy(ABC):
    """Chooses the prefill instance for one request."""

    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]]
    #: decode selector used unless the configuration names another
    default_decode: ClassVar[str] = "least-load"
    #: what the policy is published with beyond placing (admission, shedding, ...); the
    #: configuration may override each (:mod:`..capabilities`)
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, params: BaseModel, ctx: PolicyContext) -> None:
        self.params = params
        self.ctx = ctx

    def choose(self, req: RequestInfo, cluster: ClusterState, now: float) -> Placement:
        """Pick a prefill instance for ``req`` among the live ones (none live: reject)."""
        live = [p for p in cluster.prefill if p.up]
        if not live:
            return Placement(prefill=None, reject_reason="no-prefill-instance")
        return self.pick(req, cluster, live, now)

    @abstractmethod
    def pick(
        self, req: RequestInfo, cluster: ClusterState, live: list[PrefillState], now: float
    ) -> Placement:
        """The policy's rule: choose among ``live`` (never empty)."""

    def on_placed(self, req: RequestInfo, placement: Placement, cluster: ClusterState) -> None:  # noqa: B027
        """Hook after a placement is committed (approximate-tree policies learn here)."""

    def on_prefilled(self, req: RequestInfo, placement: Placement) -> None:  # noqa: B027
        """Hook when a placed request's prefill is done (its first token): routers that
        count in-flight prefill work release it here."""

    def on_finished(self, req: RequestInfo, placement: Placement) -> None:  # noqa: B027
        """Hook when a placed request is done: its last token sent, or it failed (routers
        that count their own outstanding requests release it here)."""

    def explain(self, req: RequestInfo, cluster: ClusterState, now: float,
                top: int) -> list[dict[str, float | int]]:
        """The ``top`` best options for ``req`` as the policy sees them, best first, without
        changing anything (what a gateway shows for an explained decision). By default:
        every live prefill instance recomputing past its own prefix (stored or pending) as
        its queue stands, by TTFT; a policy that prices more overrides it."""
        matched = cluster.index.match_all(req.keys, cluster.prefill_mask, include_pending=True,
                                          key_array=req.key_array)
        rows: list[dict[str, float | int]] = []
        for p in cluster.prefill:
            if not p.up:
                continue
            pl = self.local_placement(req, p, matched.get(p.iid, 0), now)
            rows.append({"instance": p.iid, "matched_blocks": pl.local_blocks,
                         "cached_tokens": req.tokens_of(pl.local_blocks), "queue_s": pl.queue_s,
                         "prefill_s": pl.prefill_s, "ttft_s": pl.queue_s + pl.prefill_s})
        rows.sort(key=lambda r: r["ttft_s"])  # stable: equal ones in pool order
        return rows[:top]

    # -- helpers shared by several policies ---------------------------------------------------
    def local_placement(
        self, req: RequestInfo, inst: PrefillState, local_blocks: int, now: float
    ) -> Placement:
        """Placement on ``inst`` reusing only its own cache, FIFO queue."""
        cached = req.tokens_of(local_blocks)
        return Placement(
            prefill=inst.iid,
            local_blocks=local_blocks,
            queue_s=inst.wait_time(now),
            prefill_s=self.ctx.cost.prefill_time(req.input_tokens, cached),
        )


P = TypeVar("P", bound=type[PrefillPolicy])
#: every registered policy class by name (filled by :func:`register`, read by :mod:`.registry`)
_REGISTRY: dict[str, type[PrefillPolicy]] = {}


def register(cls: P) -> P:
    """Class decorator: enter a policy class in the registry under its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def router_mask(index: PrefixIndex, iids: Iterable[int]) -> int:
    """Bit mask of ``iids`` in a router-side index (an approximate tree the policy fills
    from its own decisions), adding the instances it has not seen yet."""
    mask = 0
    for iid in iids:
        mask |= 1 << iid
        if not index.live_mask >> iid & 1:
            index.add_instance(iid)
    return mask


def longest(matches: dict[int, int]) -> tuple[int | None, int]:
    """The holder of the longest prefix in a ``match_all`` result and its length in blocks
    (``(None, 0)`` when nothing matches; the first such holder on ties)."""
    best_src, best_len = None, 0
    for iid, m in matches.items():
        if m > best_len:
            best_src, best_len = iid, m
    return best_src, best_len


def least(
    items: list[tuple[float, int]], rng: random.Random, rel_tol: float = 1e-9
) -> int:
    """Id with the smallest value; ties (within ``rel_tol``) broken at random so equal
    instances share the load instead of the first one always winning."""
    best = min(v for v, _ in items)
    tol = abs(best) * rel_tol + 1e-12
    ties = [i for v, i in items if v <= best + tol]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
