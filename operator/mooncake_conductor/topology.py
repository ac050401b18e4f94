"""Fleet topology: where instances sit, and what a KV transfer between two places costs
(the Mooncake paper's §5.3 and §6.4: transfers inside an NVLink domain or rack are
cheaper than across racks or zones).

A *place* is a tuple of labels, one per :class:`LinkLevel` of the configuration, finest
first (e.g. ``("rack-3", "zone-a")``), interned as a small integer (:meth:`Topology.
place_id`); 0 is the unknown place. Two instances whose places differ talk over the link
of the *coarsest* level where their labels differ (another zone: the zone link, even if
the racks differ too); instances in one place, or where either place is unknown, over the
cost model's own link (its NIC, ``min(B_nic, B_h2d)``). A level's link never beats the
cost model's own: a transfer across it takes ``latency + bytes / min(level bandwidth x
transfer efficiency, the cost model's link)``.

With no levels the fleet is flat and every answer is the cost model's (bit for bit what
it was before topology existed). With ``aware: false`` the costs are still what the
simulator charges, but the Conductor decides as if the fleet were flat: the "off"
column of ``benchmarks/topology.py``.

What decisions do with it (``aware`` and some level configured, :attr:`Topology.active`):

- a KV prefix fetch is priced from the *nearest* instance holding the longest prefix
  (``conductor``'s ranking, its CPP groups and work stealing);
- the prefill→decode KV stream makes the decode selector prefer, among instances whose
  predicted step is near-equal, those nearest the prefill instance;
- a CPP group's stage hand-off runs over the slowest link between its members, and
  groups of one domain are priced beside the least-loaded mix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from .scoring_kernel import TopoArrays
from .state import board_of

if TYPE_CHECKING:
    from .cost import CostModel
    from .state import ClusterState

class _Placed(Protocol):
    @property
    def place(self) -> int: ...


_P = TypeVar("_P", bound=_Placed)

#: the place of an instance whose labels are unknown (it talks over the cost model's link)
UNKNOWN = 0


class LinkLevel(BaseModel):
    """One level of the fleet's hierarchy and the link between instances that differ at
    it (and at no coarser level)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1, description="e.g. rack, zone")
    gbits_per_s: float = Field(
        ..., gt=0, description="link bandwidth between instances that differ at this level")
    latency_s: float = Field(0.0, ge=0, description="added once per transfer")


class TopologyConfig(BaseModel):
    """The fleet's levels, finest first (none: a flat fleet), and whether decisions use
    them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    levels: list[LinkLevel] = Field(
        default_factory=list, description="finest first; empty: a flat fleet")
    aware: bool = Field(
        True, description="decisions use the topology (false: its costs are still charged "
        "by the simulator, but decisions ignore them)")


class Topology:
    """Interned places and the link between any two (pure arithmetic, no I/O)."""

    def __init__(self, config: TopologyConfig) -> None:
        self.config = config
        self.levels = list(config.levels)
        self._ids: dict[tuple[str, ...], int] = {}
        self._labels: list[tuple[str, ...]] = [()]  # id -> labels; 0: unknown
        self._bytes_per_s = [lv.gbits_per_s * 1e9 / 8.0 for lv in self.levels]
        self._latency = [lv.latency_s for lv in self.levels]
        self._matrix: npt.NDArray[np.int64] | None = None
        self._links: tuple[float, npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None

    @property
    def active(self) -> bool:
        """Whether decisions use the topology: ``aware`` and some level configured."""
        return self.config.aware and bool(self.levels)

    @property
    def places(self) -> int:
        """Place ids handed out so far, the unknown place 0 included."""
        return len(self._labels)

    def labels(self, place: int) -> tuple[str, ...]:
        """The labels of place id ``place`` (``()`` for the unknown place)."""
        return self._labels[place]

    def place_id(self, labels: Sequence[str]) -> int:
        """The id of the place ``labels`` (finest first, one value per level), interned on
        first sight; ``()``, all-empty labels or a flat fleet: 0 (unknown). Labels of
        another length than the configured levels are a configuration error."""
        key = tuple(labels)
        if not self.levels or not any(key):
            return UNKNOWN
        if len(key) != len(self.levels):
            names = ", ".join(lv.name for lv in self.levels)
            raise ValueError(f"a place needs one label per level ({names}), got {key!r}")
        pid = self._ids.get(key)
        if pid is None:
            pid = self._ids[key] = len(self._labels)
            self._labels.append(key)
            self._matrix = None
        return pid

    def level(self, a: int, b: int) -> int:
        """The level two places talk over: -1 (the cost model's own link) when they are
        one place or either is unknown; else the index of the coarsest level whose labels
        differ."""
        if a == b or UNKNOWN in (a, b):
            return -1
        la, lb = self._labels[a], self._labels[b]
        for k in range(len(la) - 1, -1, -1):
            if la[k] != lb[k]:
                return k
        return -1

    def group_level(self, places: Iterable[int]) -> int:
        """The slowest link between any two of ``places``: their largest :meth:`level`."""
        distinct = sorted(set(places))
        worst = -1
        for i, a in enumerate(distinct):
            for b in distinct[i + 1:]:
                worst = max(worst, self.level(a, b))
        return worst

    def link(self, cost: CostModel, level: int) -> tuple[float, float]:
        """``(bytes per second, latency)`` of a transfer over ``level``'s link (-1: the cost
        model's own link, no latency)."""
        own = cost.link_bytes_per_s
        if level < 0:
            return own, 0.0
        eff = cost.config.efficiency.transfer_efficiency
        return min(self._bytes_per_s[level] * eff, own), self._latency[level]

    def transfer_time(self, cost: CostModel, tokens: int, a: int, b: int) -> float:
        """Seconds to move the KV of ``tokens`` from place ``a`` to place ``b``: the cost
        model's :meth:`~.cost.CostModel.transfer_time` over its own link (level -1), else
        the level's latency plus the bytes over the slower of its link and the model's."""
        lv = self.level(a, b)
        if lv < 0:
            return cost.transfer_time(tokens)
        if tokens <= 0:
            return 0.0
        bw, latency = self.link(cost, lv)
        return latency + tokens * cost.kv_bytes_per_token / bw

    def nearest(self, cost: CostModel, tokens: int, sources: Sequence[int],
                target: int) -> tuple[int, float]:
        """Of the places ``sources`` (holders of one prefix), the position of the one
        ``tokens`` of KV come from fastest to ``target`` (the first on ties) and that
        time."""
        best_pos, best = 0, float("inf")
        for pos, src in enumerate(sources):
            t = self.transfer_time(cost, tokens, src, target)
            if t < best:
                best_pos, best = pos, t
        return best_pos, best

    def stream_join(self, cost: CostModel, tokens: int, a: int, b: int, start: float,
                    end: float) -> float:
        """When the last layer's KV of a prompt of ``tokens``, prefilled on place ``a``
        from ``start`` to ``end``, has reached place ``b``: the stream runs layer by layer
        beside the prefill (paper §3), so the decode instance waits for the last layer's
        share after the prefill ends, ``end + T / layers`` for a stream that takes ``T``
        in all (a flat fleet: exactly that). With levels configured it also cannot end
        before ``start + T`` plus the link's latency: a link slower than the prefill
        produces KV holds the stream back."""
        layers = cost.config.model.layers
        if not self.levels:
            return end + cost.transfer_time(tokens) / layers
        lv = self.level(a, b)
        bw, latency = self.link(cost, lv)
        total = max(0, tokens) * cost.kv_bytes_per_token / bw
        return max(end + total / layers, start + total) + latency

    def kernel_arrays(self, cost: CostModel) -> tuple[npt.NDArray[np.int64],
                                                       npt.NDArray[np.float64],
                                                       npt.NDArray[np.float64]]:
        """What the compiled rankings read: the level of every pair of place ids (a square
        matrix), and per level + 1 (index 0: the cost model's own link) the bytes per
        second and the latency of its link."""
        if self._matrix is None:
            n = self.places
            self._matrix = np.array([[self.level(a, b) for b in range(n)] for a in range(n)],
                                    dtype=np.int64).reshape(n, n)
        own = cost.link_bytes_per_s
        if self._links is None or self._links[0] != own:
            links = [self.link(cost, lv) for lv in range(-1, len(self.levels))]
            self._links = (own, np.array([bw for bw, _ in links]),
                           np.array([lat for _, lat in links]))
        return self._matrix, self._links[1], self._links[2]


def assign_places(count: int, domains: Sequence[int], names: Sequence[str],
                  blocked: bool = True) -> list[tuple[str, ...]]:
    """Labels for ``count`` instances spread over ``domains[k]`` domains at level ``k``
    (finest first; each level's domains nest in the next coarser one's): instance ``i``
    goes to finest domain ``i * d0 // count`` (``blocked``: neighbours share a domain) or
    ``i % d0`` (round-robin), and finest domain ``r`` lies in domain ``r * dk // d0`` of
    level ``k``. Labels read ``<level name>-<index>``."""
    if len(domains) != len(names):
        raise ValueError("one domain count per level")
    if not domains:
        return [() for _ in range(count)]
    d0 = domains[0]
    if any(d < 1 for d in domains) or any(d > d0 for d in domains):
        raise ValueError("every level needs at least one domain, at most the finest's count")
    out: list[tuple[str, ...]] = []
    for i in range(count):
        r = i * d0 // count if blocked else i % d0
        out.append(tuple(f"{name}-{r * d // d0}" for name, d in zip(names, domains,
                                                                       strict=True)))
    return out


def narrow_to_nearest(topology: Topology, near: int, place: npt.NDArray[np.int64],
                      step: npt.NDArray[np.float64], ties: npt.NDArray[np.int64], count: int,
                      tol: float, eps: float) -> int:
    """Of the ``count`` decode rows in ``ties`` (near-equal steps in ``step``), keep those
    whose place is nearest place ``near`` (the lowest :meth:`Topology.level`), then those
    inside the tie band ``best + (|best| * tol + eps)`` of the best step among them, in
    order, at the front of ``ties``; returns how many are kept."""
    rows = ties[:count].tolist()
    levels = [topology.level(near, int(place[r])) for r in rows]
    top = min(levels)
    kept = [r for r, lv in zip(rows, levels, strict=True) if lv == top]
    best = min(float(step[r]) for r in kept)
    band = best + (abs(best) * tol + eps)
    kept = [r for r in kept if step[r] <= band]
    ties[:len(kept)] = kept
    return len(kept)


class FetchSources:
    """The holders of a request's longest prefix a fetch may come from: instance ids
    (live prefill instances, and the store pool, whose place is unknown) and their
    places, for one decision."""

    __slots__ = ("_arrays", "_distinct", "ids", "places", "topology")

    def __init__(self, topology: Topology, ids: list[int], places: list[int]) -> None:
        self.topology = topology
        self.ids = ids
        self.places = places
        self._distinct = sorted(set(places))
        self._arrays: TopoArrays | None = None

    @classmethod
    def of(cls, topology: Topology, cluster: ClusterState, stored: npt.NDArray[np.int64],
           length: int) -> FetchSources | None:
        """The instances whose stored prefix (``stored``, blocks by instance id) is at
        least ``length`` blocks, in id order; ``None`` when there are none."""
        if length <= 0:
            return None
        board = board_of(cluster.prefill)
        place, up = board["place"], board["up"]
        ids: list[int] = []
        places: list[int] = []
        for iid in np.flatnonzero(stored >= length).tolist():
            if iid == cluster.store_id:
                ids.append(iid)
                places.append(UNKNOWN)
                continue
            row = board.row_of(iid)
            if row >= 0 and up[row]:
                ids.append(iid)
                places.append(int(place[row]))
        return cls(topology, ids, places) if ids else None

    def time_to(self, cost: CostModel, tokens: int, place: int) -> float:
        """Seconds ``tokens`` of the prefix take from the nearest holder to ``place``."""
        return self.topology.nearest(cost, tokens, self._distinct, place)[1]

    def source_for(self, cost: CostModel, tokens: int, place: int) -> int:
        """The holder ``tokens`` come from fastest to ``place`` (the lowest id on ties)."""
        pos, _ = self.topology.nearest(cost, tokens, self.places, place)
        return self.ids[pos]

    def arrays(self, cost: CostModel, place: npt.NDArray[np.int64]) -> TopoArrays:
        """:class:`~.scoring_kernel.TopoArrays` for a ranking over rows with places ``place``."""
        if self._arrays is None or self._arrays.place is not place:
            levels, bw, latency = self.topology.kernel_arrays(cost)
            self._arrays = TopoArrays(place, np.array(self._distinct, dtype=np.int64),
                                      levels, bw, latency)
        return self._arrays


#: at most this many places seed a CPP group of their own (:func:`domain_orders`)
MAX_DOMAIN_ORDERS = 8


def domain_orders(topology: Topology, by_wait: Sequence[_P]) -> list[Sequence[_P]]:
    """The orders CPP groups are drawn from (a group of ``k`` takes the first ``k``):
    ``by_wait`` itself (the instances that free first), then, for each place among
    them in that order (at most :data:`MAX_DOMAIN_ORDERS`), the instances nearest that
    place first (by :meth:`Topology.level`), each level in ``by_wait``'s order: the group
    of one domain where it has enough members, spilling over to the next nearest."""
    orders: list[Sequence[_P]] = [by_wait]
    seeds: list[int] = []
    for p in by_wait:
        if p.place not in seeds:
            seeds.append(p.place)
            if len(seeds) == MAX_DOMAIN_ORDERS:
                break
    if len(seeds) < 2:
        return orders  # one place: nothing to prefer
    for seed in seeds:
        orders.append(sorted(by_wait, key=lambda p: topology.level(seed, p.place)))
    return orders
