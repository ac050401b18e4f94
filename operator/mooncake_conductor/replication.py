"""Hot-prefix replication (seed §7; paper §4.2 "hotspot migration", done ahead of need).

Rule: every scheduled request records an access to the longest prefix the
cluster holds for it. Access rates decay exponentially (``half_life_s``). A
prefix is *hot* when its rate reaches ``min_rate_per_s``; it is a *hot spot*
when even its least loaded holder is loaded past ``load_ratio`` times the
pool's average (predicted queue seconds, plus ``load_floor_s`` so an idle pool
never counts as hot) and it has fewer than ``max_replicas`` copies. For each
hot spot, up to ``max_actions`` per round, copy the prefix from that holder to
the least loaded live instance that does not hold it and has room: loaded
below the average, preferring caches under ``max_fill`` (a full LRU cache
makes room by dropping its least recently used blocks).

Output: :class:`ReplicationAction` ``(prefix, source, target)``. The simulator
applies an action after its transfer time; the operator turns it into a
replica annotation on the target pod, whose worker warms the prefix.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from .state import ClusterState

_K = TypeVar("_K")


class ReplicationConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    interval_s: float = Field(5.0, gt=0, description="how often a plan is made")
    half_life_s: float = Field(60.0, gt=0, description="access-rate decay half-life")
    min_rate_per_s: float = Field(0.05, gt=0, description="accesses per second to be hot")
    min_blocks: int = Field(2, ge=1, description="shorter prefixes are not worth a copy")
    load_ratio: float = Field(1.5, ge=1, description="holder load / average to be a hot spot")
    load_floor_s: float = Field(0.5, ge=0, description="added to the average load")
    max_replicas: int = Field(4, ge=1, description="most copies of one prefix")
    max_fill: float = Field(0.95, gt=0, le=1, description="target cache fill limit")
    max_actions: int = Field(4, ge=0, description="actions per round")
    max_tracked: int = Field(4096, gt=0, description="prefixes tracked (LRU)")


@dataclass(frozen=True, slots=True)
class ReplicationAction:
    prefix: int  # the key of the prefix's last block: names the whole prefix
    keys: tuple[int, ...]
    source: int
    target: int
    rate_per_s: float


#: seconds of slack on the ``until`` pre-filter (float rounding of the log)
_UNTIL_SLACK_S = 1e-6


@dataclass(slots=True)
class _Tracked:
    #: a uint64 array when the caller had one: never traversed by the garbage collector
    #: (a tuple of ~500 ints is, once; a few hundred new ones add up to milliseconds)
    keys: tuple[int, ...] | npt.NDArray[np.uint64]
    rate: float
    at: float
    #: when the decaying rate falls below the hot threshold (a pre-filter for ``hot``)
    until: float = -math.inf

    def key_tuple(self) -> tuple[int, ...]:
        return self.keys if isinstance(self.keys, tuple) else tuple(self.keys.tolist())


class HotPrefixTracker:
    """Access rates of prefixes, and replication plans from them."""

    def __init__(self, config: ReplicationConfig | None = None) -> None:
        self.config = config or ReplicationConfig()
        self._tracked: OrderedDict[int, _Tracked] = OrderedDict()
        self._decay = math.log(2.0) / self.config.half_life_s
        #: the longest any prefix has stayed hot after its last access: the LRU order is
        #: the order of last access, so ``hot`` stops at the first prefix older than this
        self._longest_hot_s = 0.0
        #: accesses recorded in time order so far (else the early stop is off for good)
        self._in_order = True
        self._last_at = -math.inf

    def record(self, keys: list[int] | tuple[int, ...], now: float,
               blocks: int | None = None,
               key_array: npt.NDArray[np.uint64] | None = None) -> None:
        """One access to the prefix ``keys[:blocks]`` (default all: the blocks the
        cluster already holds); the keys are copied only for a new prefix, from
        ``key_array`` (the same keys as uint64) when there is one."""
        blocks = len(keys) if blocks is None else min(blocks, len(keys))
        if blocks < self.config.min_blocks:
            return
        prefix = keys[blocks - 1]
        t = self._tracked.get(prefix)
        if t is None:
            t = _Tracked(tuple(keys[:blocks]) if key_array is None
                         else key_array[:blocks].copy(), 0.0, now)
            self._tracked[prefix] = t
            if len(self._tracked) > self.config.max_tracked:
                self._tracked.popitem(last=False)
        else:
            self._tracked.move_to_end(prefix)
        t.rate = self._rate(t, now) + self._decay  # each access adds decay-rate units
        t.at = now
        if now < self._last_at:
            self._in_order = False
        self._last_at = max(self._last_at, now)
        floor = self.config.min_rate_per_s
        t.until = now + math.log(t.rate / floor) / self._decay if t.rate >= floor else now
        self._longest_hot_s = max(self._longest_hot_s, t.until - now)

    def _rate(self, t: _Tracked, now: float) -> float:
        return t.rate * math.exp(-self._decay * max(0.0, now - t.at))

    def hot(self, now: float) -> list[tuple[int, float, tuple[int, ...]]]:
        """Hot prefixes ``(prefix, accesses per second, keys)``, hottest first."""
        return [(p, r, t.key_tuple()) for p, r, t in self._hot(now)]

    def _hot(self, now: float) -> list[tuple[int, float, _Tracked]]:
        # newest access first, down to the oldest that can still be hot; ``until`` skips
        # the exponential for the ones already cold; the slack leaves the exact test to
        # the rate itself at the boundary
        soon = now - _UNTIL_SLACK_S
        oldest = soon - self._longest_hot_s
        floor = self.config.min_rate_per_s
        out = []
        for p, t in reversed(self._tracked.items()):
            if t.at < oldest and self._in_order:
                break
            if t.until >= soon and (r := self._rate(t, now)) >= floor:
                out.append((p, r, t))
        out.reverse()  # least recent first, so equal rates keep their old order
        out.sort(key=lambda x: -x[1])
        return out

    def plan(self, cluster: ClusterState, now: float) -> list[ReplicationAction]:
        cfg = self.config
        if not cfg.enabled or cfg.max_actions == 0:
            return []
        live = [p for p in cluster.prefill if p.up]
        if len(live) < 2:
            return []
        load = {p.iid: p.wait_time(now) for p in live}
        avg = sum(load.values()) / len(live)
        if not any(is_hot_spot(v, avg, cfg) for v in load.values()):
            return []  # every source must be a hot spot: none can be
        index = cluster.index
        actions: list[ReplicationAction] = []
        taken: set[int] = set()
        for prefix, rate, tracked in self._hot(now):
            keys = tracked.key_tuple()
            holders = [p.iid for p in live if index.match(p.iid, keys) == len(keys)]
            if not holders or len(holders) >= cfg.max_replicas:
                continue
            source = min(holders, key=lambda i: load[i])
            if not is_hot_spot(load[source], avg, cfg):
                continue
            target = pick_target(
                [p.iid for p in live if p.iid not in holders and p.iid not in taken],
                load, avg, lambda i: index.size(i) >= cfg.max_fill * index.capacity(i))
            if target is None:
                continue
            taken.add(target)
            actions.append(ReplicationAction(prefix, keys, source, target, rate))
            if len(actions) >= cfg.max_actions:
                break
        return actions


def is_hot_spot(holder_load: float, average_load: float, cfg: ReplicationConfig) -> bool:
    """Even the least loaded holder is loaded past ``load_ratio`` x the pool's average
    (plus ``load_floor_s``, so an idle pool never has hot spots)."""
    return holder_load > cfg.load_ratio * average_load + cfg.load_floor_s


def pick_target(candidates: Sequence[_K], load: Mapping[_K, float], average_load: float,
                full: Callable[[_K], bool]) -> _K | None:
    """The least loaded candidate loaded at most the average, preferring one whose cache is
    not full (``full``); ``None`` when none qualifies."""
    ok = [i for i in candidates if load[i] <= average_load]
    if not ok:
        return None
    return min(ok, key=lambda i: (full(i), load[i]))


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A hot prefix as an outside observer reports it (the gateway's hot-prefix list)."""

    prefix: str
    rate_per_s: float
    blocks: int
    #: instances that hold all of it now (cached on their own, or a finished replica)
    holders: frozenset[str]


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """A live prefill instance: predicted queue seconds and cache fill (0..1)."""

    name: str
    load_s: float
    fill: float = 0.0


def assign_replicas(hot: Sequence[HotPrefix], instances: Sequence[InstanceLoad],
                    current: Mapping[str, frozenset[str]],
                    cfg: ReplicationConfig) -> dict[str, frozenset[str]]:
    """Which instance should hold a replica of which hot prefix (the operator's Conductor
    controller writes the answer into pod annotations; level-based, so it is the whole
    desired assignment, not a list of moves).

    - An assignment stays while its prefix is still hot and its instance live; it goes
      when the prefix cools (drops out of ``hot``) or the instance leaves.
    - New ones follow :meth:`HotPrefixTracker.plan`'s rule: for each hot prefix, hottest
      first, with fewer than ``max_replicas`` copies (holders and assignments together)
      whose least loaded copy is a hot spot (:func:`is_hot_spot`), one more copy on
      :func:`pick_target` among instances not holding or assigned it, one new copy per
      instance and at most ``max_actions`` per call.
    """
    live = {i.name: i for i in instances}
    hot_ids = {h.prefix for h in hot}
    out: dict[str, set[str]] = {
        name: {p for p in current.get(name, ()) if p in hot_ids} for name in live
    }
    if not cfg.enabled or len(live) < 2:
        return {k: frozenset(v) for k, v in out.items()}
    load = {name: i.load_s for name, i in live.items()}
    avg = sum(load.values()) / len(live)
    added = 0
    taken: set[str] = set()
    for h in sorted(hot, key=lambda x: -x.rate_per_s):
        if added >= cfg.max_actions:
            break
        if h.blocks < cfg.min_blocks:
            continue
        copies = {n for n in h.holders if n in live} | {n for n in live if h.prefix in out[n]}
        if not copies or len(copies) >= cfg.max_replicas:
            continue
        if not is_hot_spot(min(load[n] for n in copies), avg, cfg):
            continue
        target = pick_target([n for n in sorted(live) if n not in copies and n not in taken],
                             load, avg, lambda n: live[n].fill >= cfg.max_fill)
        if target is None:
            continue
        out[target].add(h.prefix)
        taken.add(target)
        added += 1
    return {k: frozenset(v) for k, v in out.items()}
