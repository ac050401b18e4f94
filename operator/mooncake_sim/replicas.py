"""Several Conductor replicas behind one front, each seeing the others' requests late.

Model (issue 33 item 6, the paper's future work of a distributed Conductor): a front
spreads the requests over ``n`` replicas round-robin (as a Service does). Every replica
decides with the whole cluster's state except the other replicas' placements of the last
``lag_s`` seconds, which it has not heard of yet: their queued and running prefill work,
and the decode sequences they joined or finished in that window, are taken out of (or
put back into) its view for its decision. ``lag_s`` infinite: the replicas never share
load (each sees only its own requests), as gateways without the peer exchange.

What every replica shares at once: the prefix index (the engines' KV events;
``event_lag_ms`` delays it for everyone alike), the drain of work it knows of (a replica
predicts it, as the gateway's ``drain`` does), calibration and the Conductor's own
trackers (one :class:`~mooncake_conductor.engine.Conductor` object serves every replica),
and work stealing, which runs on the truth.

With ``lag_s`` 0 nothing is hidden, so any ``n`` gives the one-replica decisions exactly
(a test checks it).

Source: ours; the sync channel is the one the live gateways use
(``mooncake_conductor/peerload.py``, issue 32 item 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mooncake_conductor.state import (
    ClusterState,
    DecodeState,
    PrefillState,
    QueuedWork,
    RequestInfo,
)

#: what a view changed on a prefill state: (state, busy_until, queued_work_s, queue_len,
#: queue), restored on exit
_PrefillUndo = tuple[PrefillState, float, float, int, list[QueuedWork]]


@dataclass(slots=True)
class _Seq:
    """A decode sequence's join or finish that other replicas may not have heard of."""

    at: float
    did: int
    joined: bool  # True: a join (the view leaves it out); False: a finish (put back in)
    context: int
    reserved: int


class ReplicaViews:
    """Which replica decides each request, and each replica's view of the cluster."""

    def __init__(self, n: int, lag_s: float) -> None:
        if n < 1:
            raise ValueError("at least one replica")
        if lag_s < 0:
            raise ValueError("lag_s must be >= 0 (math.inf: never shared)")
        self.n = n
        self.lag_s = lag_s
        #: per replica: request id -> when it was placed (its prefill not heard of yet)
        self._placed: list[dict[int, float]] = [{} for _ in range(n)]
        #: per replica: request id -> its decode join or finish not heard of yet
        self._seqs: list[dict[int, _Seq]] = [{} for _ in range(n)]
        self.hidden_prefills = 0  # over all decisions: placements left out of a view
        self.hidden_sequences = 0

    @property
    def active(self) -> bool:
        return self.n > 1 and self.lag_s > 0

    def replica_of(self, info: RequestInfo) -> int:
        return info.rid % self.n

    # -- what the replicas do ----------------------------------------------------------------
    def placed(self, replica: int, rid: int, now: float) -> None:
        if self.active:
            self._placed[replica][rid] = now

    def joined(self, replica: int, rid: int, did: int, context: int, reserved: int,
               now: float) -> None:
        if self.active:
            self._seqs[replica][rid] = _Seq(now, did, True, context, reserved)

    def finished(self, replica: int, rid: int, did: int, context: int, now: float) -> None:
        if not self.active:
            return
        seqs = self._seqs[replica]
        seen = seqs.get(rid)
        if seen is not None and seen.joined and now - seen.at < self.lag_s:
            del seqs[rid]  # joined and finished unheard of: no trace in any view
        else:
            seqs[rid] = _Seq(now, did, False, context, 0)

    # -- a replica's view ----------------------------------------------------------------------
    @contextmanager
    def view(self, replica: int, cluster: ClusterState, now: float,
             where: Callable[[int], list[int]], running: Callable[[int], int]
             ) -> Iterator[None]:
        """Within the block, ``cluster`` is what ``replica`` knows at ``now``: the other
        replicas' placements and decode changes of the last ``lag_s`` are undone, and
        restored exactly on exit. ``where(rid)``: the prefill instances a placed
        request's work is on; ``running(iid)``: the request instance ``iid`` runs (-1:
        none)."""
        if not self.active:
            yield
            return
        prefill_undo = self._hide_prefills(replica, cluster, now, where, running)
        decode_undo = self._hide_sequences(replica, cluster.decode, now)
        try:
            yield
        finally:
            for p, busy, work, qlen, queue in prefill_undo:
                p.queue = queue
                p.queue_len = qlen
                p.queued_work_s = work
                p.busy_until = busy
            for d, batch, context, reserved in decode_undo:
                d.batch, d.context_tokens, d.reserved_tokens = batch, context, reserved

    def _hide_prefills(self, replica: int, cluster: ClusterState, now: float,
                       where: Callable[[int], list[int]], running: Callable[[int], int]
                       ) -> list[_PrefillUndo]:
        hidden: dict[int, set[int]] = {}  # instance -> unheard-of request ids on it
        for other, placed in enumerate(self._placed):
            if other == replica:
                continue
            for rid, at in list(placed.items()):
                members = where(rid)
                if not members or now - at >= self.lag_s:
                    del placed[rid]  # done, or heard of by now
                    continue
                for iid in members:
                    hidden.setdefault(iid, set()).add(rid)
        undo: list[_PrefillUndo] = []
        pool = cluster.prefill
        for iid, rids in hidden.items():
            p = pool[iid]
            kept = [q for q in p.queue if q.rid not in rids]
            gone = len(p.queue) - len(kept)
            runs = running(iid) in rids and p.busy_until > now
            if not gone and not runs:
                continue
            self.hidden_prefills += gone + runs
            undo.append((p, p.busy_until, p.queued_work_s, p.queue_len, p.queue))
            if gone:
                hidden_work = sum(q.work_s for q in p.queue if q.rid in rids)
                p.queue = kept
                p.queue.sort()
                p.queue_len = len(kept)
                p.queued_work_s = max(0.0, p.queued_work_s - hidden_work)
            if runs:
                p.busy_until = now  # its running prefill is unheard of: idle to this view
        return undo

    def _hide_sequences(self, replica: int, pool: list[DecodeState], now: float
                        ) -> list[tuple[DecodeState, int, int, int]]:
        delta: dict[int, list[int]] = {}  # decode instance -> [batch, context, reserved]
        for other, seqs in enumerate(self._seqs):
            if other == replica:
                continue
            for rid, s in list(seqs.items()):
                if now - s.at >= self.lag_s:
                    del seqs[rid]
                    continue
                sign = -1 if s.joined else 1
                d = delta.setdefault(s.did, [0, 0, 0])
                d[0] += sign
                d[1] += sign * s.context
                d[2] += sign * s.reserved
                self.hidden_sequences += 1
        undo = []
        for did, (b, c, r) in delta.items():
            st = pool[did]
            undo.append((st, st.batch, st.context_tokens, st.reserved_tokens))
            st.batch = max(0, st.batch + b)
            st.context_tokens = max(0, st.context_tokens + c)
            st.reserved_tokens = max(0, st.reserved_tokens + r)
        return undo

