"""The Conductor controller: hot-prefix replicas as pod annotations.

Per cluster, every ``conductor.hotPrefixes.intervalSeconds``: read the gateway's hot
prefixes (with their holders and token ids) and its registry (each prefill pod's predicted
queue), let the core decide which prefill pods should hold which hot prefixes
(:func:`mooncake_conductor.replication.assign_replicas`, the paper's hot-spot rule), and
patch ``mooncake.io/replicas`` on the pods whose set changed — at most
``maxPatchesPerInterval`` pods per round. The pod's agent warms what is listed (from the
Mooncake Store when it holds the blocks, else by computing) and its KV events tell the
gateway, which then spreads the prefix's requests; an entry whose prefix went cold is
removed and its blocks age out.

Annotation entries carry the prefix's token ids when the gateway knows them (the agent of
a real engine can only warm from tokens) and its block keys when the store holds the
blocks; entries are added hottest first within ``maxAnnotationBytes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from mooncake_conductor.replication import (
    HotPrefix,
    InstanceLoad,
    ReplicationConfig,
    assign_replicas,
)
from mooncake_contract import conventions as c
from mooncake_contract.annotations import ReplicaSpec, format_replicas, parse_replicas

from .observe import PodView, Registry
from .spec import HotPrefixSpec, HotPrefixStatus

log = logging.getLogger(__name__)
JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class HotEntry:
    """One hot prefix from the gateway."""

    prefix: str
    rate_per_s: float
    blocks: int
    holders: frozenset[str]  # pod names (no namespace)
    tokens: list[int] | None
    keys: list[int] | None


@dataclass(slots=True)
class ControllerPlan:
    patches: dict[str, str] = field(default_factory=dict)  # pod name -> annotation value
    added: list[tuple[str, str]] = field(default_factory=list)  # (prefix, pod)
    removed: list[tuple[str, str]] = field(default_factory=list)
    deferred: int = 0  # pods whose change waits for the next round (rate limit)
    status: list[HotPrefixStatus] = field(default_factory=list)


def _pod_name(full: str) -> str:
    return full.rpartition("/")[2]


def parse_hot(data: JsonDict | None) -> list[HotEntry]:
    """The gateway's ``/conductor/hot-prefixes`` answer as entries."""
    if not data:
        return []
    items = data.get("hot_prefixes") or data.get("items") or data.get("prefixes") or []
    out: list[HotEntry] = []
    for item in items:
        if not isinstance(item, dict) or "prefix" not in item:
            continue
        raw_tokens = item.get("token_ids")
        if raw_tokens is None and isinstance(item.get("tokens"), list):
            raw_tokens = item["tokens"]
        keys = item.get("keys")
        out.append(HotEntry(
            prefix=str(item["prefix"]), rate_per_s=float(item.get("rate_per_s") or 0.0),
            blocks=int(item.get("blocks") or 0),
            holders=frozenset(_pod_name(str(h)) for h in item.get("holders") or []),
            tokens=[int(t) for t in raw_tokens] if isinstance(raw_tokens, list) else None,
            keys=[int(str(k), 16) for k in keys] if isinstance(keys, list) else None,
        ))
    return out


def current_assignments(pods: list[PodView]) -> dict[str, frozenset[str]]:
    """What each prefill pod's annotation lists now (a malformed one counts as empty)."""
    out: dict[str, frozenset[str]] = {}
    for p in pods:
        if p.role != c.ROLE_PREFILL or p.terminating:
            continue
        prefixes: frozenset[str] = frozenset()
        if p.replicas_annotation:
            try:
                prefixes = frozenset(s.prefix for s in parse_replicas(p.replicas_annotation))
            except ValueError:
                log.warning("pod %s: malformed %s, rewriting it", p.name, c.ANNOTATION_REPLICAS)
        out[p.name] = prefixes
    return out


def replication_config(hp: HotPrefixSpec) -> ReplicationConfig:
    return ReplicationConfig(
        enabled=hp.enabled, interval_s=hp.interval_seconds,
        half_life_s=hp.half_life_seconds, min_rate_per_s=hp.min_rate_per_second,
        min_blocks=hp.min_blocks, load_ratio=hp.load_ratio,
        load_floor_s=hp.load_floor_seconds, max_replicas=hp.max_replicas,
        max_actions=hp.max_patches_per_interval)


def annotation_value(prefixes: list[str], hot: dict[str, HotEntry], store: bool,
                     budget: int) -> str:
    """The replica annotation for ``prefixes`` (hottest first), within ``budget`` bytes."""
    specs: list[ReplicaSpec] = []
    for pid in sorted(prefixes, key=lambda p: -(hot[p].rate_per_s if p in hot else 0.0)):
        h = hot.get(pid)
        if h is None:
            continue
        spec = ReplicaSpec(pid, tokens=h.tokens, keys=h.keys if store else None)
        if spec.tokens is None and spec.keys is None:
            continue  # nothing to warm it from
        if len(format_replicas([*specs, spec]).encode()) > budget:
            continue
        specs.append(spec)
    return format_replicas(specs)


def plan(pods: list[PodView], registry: Registry | None, hot: list[HotEntry],
         hp: HotPrefixSpec, store: bool) -> ControllerPlan:
    """Pure: the annotation patches of one round."""
    out = ControllerPlan()
    prefill = [p for p in pods if p.role == c.ROLE_PREFILL and not p.terminating]
    current = current_assignments(prefill)
    live: list[InstanceLoad] = []
    for p in prefill:
        g = registry.get(p.name) if registry is not None else None
        if g is not None and g.routable:
            live.append(InstanceLoad(p.name, g.predicted_wait_s))
    by_id = {h.prefix: h for h in hot}
    desired = assign_replicas(
        [HotPrefix(h.prefix, h.rate_per_s, h.blocks, h.holders) for h in hot], live,
        current, replication_config(hp))
    hot_ids = {h.prefix for h in hot}
    for name in sorted(current):
        # a pod the gateway does not route to right now (a failed health check, a restart)
        # keeps what is still hot; a pod that is gone drops out of ``current`` with it
        desired.setdefault(name, frozenset(p for p in current[name] if p in hot_ids))
    changed = [n for n in sorted(desired) if desired[n] != current.get(n, frozenset())]
    # removals of cold prefixes and additions alike count against the rate limit
    for name in changed[:hp.max_patches_per_interval]:
        want, have = desired[name], current.get(name, frozenset())
        value = annotation_value(sorted(want), by_id, store, hp.max_annotation_bytes)
        written = {s.prefix for s in parse_replicas(value)}
        out.patches[name] = value
        out.added += [(p, name) for p in sorted(written - have)]
        out.removed += [(p, name) for p in sorted(have - written)]
    out.deferred = max(0, len(changed) - hp.max_patches_per_interval)
    final = {n: (frozenset(s.prefix for s in parse_replicas(out.patches[n]))
                 if n in out.patches else current.get(n, frozenset())) for n in desired}
    for h in sorted(hot, key=lambda x: -x.rate_per_s):
        assigned = sorted(n for n, ps in final.items() if h.prefix in ps)
        if assigned:
            out.status.append(HotPrefixStatus(prefix=h.prefix, blocks=h.blocks,
                                              rate_per_second=round(h.rate_per_s, 6),
                                              pods=assigned))
    return out
