"""In-flight load shared between the replicas of one scheduler.

Rule: each replica places requests on the same engines, but knows only its own
placements. So every replica reports the load of its own requests per instance (prefill:
the modelled seconds of work it has queued or running there; decode: the sequences and
the KV they hold or will hold), and adds the other replicas' latest reports to its view
as *foreign* load (:meth:`~mooncake_conductor.state.PrefillState.set_foreign`,
:meth:`~mooncake_conductor.state.DecodeState.set_foreign`). Every wait, TTFT and TBT
prediction, and so admission, then counts the whole fleet's work, a sync period late.

Instances are named (a pod's name), not numbered: replicas number their instances in the
order they discovered them. A report older than ``stale_s`` counts for nothing, so the
load of a replica that died or cannot be reached leaves every view within ``stale_s``
(its requests failed with it, or finish without it).

What is not shared: requests' prefixes (the engines' KV events already feed every
replica's index) and the order of work within an instance's queue (foreign work counts as
queued ahead of a new request, as it is in an engine that serves in arrival order).

Source: ours (issue 32 item 2: active-active gateways; the sync channel of issue 33's
distributed Conductor). Dynamo's router replicas share their active blocks the same way,
over a message bus.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .state import ClusterState


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """A replica's own prefill work on one instance."""

    work_s: float  # modelled seconds, queued and running
    requests: int


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """A replica's own sequences on one decode instance."""

    batch: int
    context_tokens: int
    reserved_tokens: int


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What one replica reports: its own load per instance name."""

    prefill: Mapping[str, PrefillLoad] = field(default_factory=dict)
    decode: Mapping[str, DecodeLoad] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "prefill": {n: {"work_s": v.work_s, "requests": v.requests}
                        for n, v in self.prefill.items()},
            "decode": {n: {"batch": v.batch, "context_tokens": v.context_tokens,
                           "reserved_tokens": v.reserved_tokens}
                       for n, v in self.decode.items()},
        }

    @classmethod
    def from_json(cls, doc: Any) -> LoadReport:
        """The report in ``doc`` (as :meth:`to_json` writes it); ``ValueError`` naming
        the first field that is missing, of the wrong type, negative or not finite."""
        if not isinstance(doc, dict):
            raise ValueError("a load report is an object")
        prefill = {name: PrefillLoad(_number(v, "work_s", f"prefill.{name}"),
                                     int(_number(v, "requests", f"prefill.{name}")))
                   for name, v in _section(doc, "prefill").items()}
        decode = {name: DecodeLoad(*(int(_number(v, key, f"decode.{name}"))
                                     for key in ("batch", "context_tokens", "reserved_tokens")))
                  for name, v in _section(doc, "decode").items()}
        return cls(prefill, decode)


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    sec = doc.get(key, {})
    if not isinstance(sec, dict):
        raise ValueError(f"{key}: an object of instance name -> load")
    return sec


def _number(entry: Any, key: str, where: str) -> float:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: an object")
    v = entry.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}.{key}: a finite number >= 0, got {v!r}")
    return float(v)


def own_report(cluster: ClusterState) -> LoadReport:
    """This replica's own load: every instance's total less what peers reported."""
    prefill = {p.name: PrefillLoad(p.own_work_s, len(p.queue))
               for p in cluster.prefill if p.queue}
    decode = {d.name: DecodeLoad(*d.own) for d in cluster.decode if d.own[0] > 0}
    return LoadReport(prefill, decode)


@dataclass(slots=True)
class _Heard:
    report: LoadReport
    at: float


class PeerLoads:
    """The latest report of each peer, and the foreign load they add up to."""

    def __init__(self, stale_s: float) -> None:
        if stale_s <= 0:
            raise ValueError("stale_s must be positive")
        self.stale_s = stale_s
        self._heard: dict[str, _Heard] = {}

    def update(self, peer: str, report: LoadReport, now: float) -> None:
        self._heard[peer] = _Heard(report, now)

    def forget(self, peer: str) -> None:
        self._heard.pop(peer, None)

    def fresh(self, now: float) -> list[str]:
        """Peers whose last report is at most ``stale_s`` old."""
        return sorted(p for p, h in self._heard.items() if now - h.at <= self.stale_s)

    def apply(self, cluster: ClusterState, now: float) -> None:
        """Set every instance's foreign load to the sum of the fresh reports (none: 0)."""
        work: dict[str, tuple[float, int]] = {}
        seqs: dict[str, tuple[int, int, int]] = {}
        for peer in self.fresh(now):
            rep = self._heard[peer].report
            for name, p in rep.prefill.items():
                w, n = work.get(name, (0.0, 0))
                work[name] = (w + p.work_s, n + p.requests)
            for name, d in rep.decode.items():
                b, c, r = seqs.get(name, (0, 0, 0))
                seqs[name] = (b + d.batch, c + d.context_tokens, r + d.reserved_tokens)
        for ps in cluster.prefill:
            ps.set_foreign(*work.get(ps.name, (0.0, 0)))
        for ds in cluster.decode:
            ds.set_foreign(*seqs.get(ds.name, (0, 0, 0)))

    def summary(self, now: float) -> dict[str, Any]:
        """Per peer: the report's age and its totals (for ``/conductor/state``)."""
        return {peer: {"age_s": round(now - h.at, 3), "fresh": now - h.at <= self.stale_s,
                       "prefill_work_s": round(sum(p.work_s for p in h.report.prefill.values()),
                                               3),
                       "decode_batch": sum(d.batch for d in h.report.decode.values())}
                for peer, h in sorted(self._heard.items())}
