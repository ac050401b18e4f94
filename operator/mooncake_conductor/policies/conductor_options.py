"""One request's options for the ``conductor`` policy: per prefill instance, recompute past
its own prefix or fetch the longest prefix any holder has (never from itself), whichever
has the lower TTFT (stage 1 of :mod:`..scoring`).

Rule (the policy's items 1-4, :mod:`.conductor`): the queue counts what runs and what is
queued (FIFO) or the work ahead at the request's priority; a fetch starts at placement and
only the part longer than the queue delays the prefill (``overlap_transfer``); the local
prefix counts blocks a queued prefill there will have written (``include_pending``), and
a request reusing them is never ordered ahead of that prefill.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..cost import CostModel
from ..scoring import Option
from ..state import ClusterState, PrefillState, RequestInfo
from ..topology import FetchSources, Topology

_AFTER = 1e-6  # priority step that orders a request right after another


class RequestOptions:
    """What pricing ``req`` on ``cluster`` at ``now`` reads, looked up once: the longest
    prefix per instance (stored; with ``include_pending``, stored or pending for the live
    ones in ``live_mask``), the longest prefix's holder, and each local match's times."""

    def __init__(self, req: RequestInfo, cluster: ClusterState, live_mask: int, now: float,
                 cost: CostModel, topology: Topology, *, fetch: bool, include_pending: bool,
                 overlap_transfer: bool, priority_weight: float) -> None:
        self.req = req
        self.now = now
        self.cost = cost
        self.overlap = overlap_transfer
        self.weight = priority_weight
        search = live_mask
        if cluster.store_id is not None:
            search |= 1 << cluster.store_id
        self.stored: npt.NDArray[np.int64]
        self.local_view: npt.NDArray[np.int64]
        self.stored, self.local_view, best_src, best_len = cluster.index.match_lengths(
            req.keys, search, live_mask if include_pending else None, key_array=req.key_array)
        if not fetch:  # local caches only: nothing is fetched
            best_src, best_len = None, 0
        self.best_src: int | None = best_src
        self.best_len = best_len
        self.best_tokens = req.tokens_of(best_len)
        self.fetch_prefill = cost.prefill_time(req.input_tokens, self.best_tokens)
        self.fetch_priority = req.arrival + priority_weight * self.fetch_prefill
        # with an active topology a fetch comes from the nearest holder of the prefix
        self.holders = (FetchSources.of(topology, cluster, self.stored, best_len)
                        if best_src is not None and topology.active else None)
        # instances with the same local match (and place) share their prefill and
        # transfer times
        self._times: dict[tuple[int, int], tuple[float, float]] = {}

    def times_of(self, local: int, place: int = 0) -> tuple[float, float]:
        """Recompute and transfer seconds for an instance holding ``local`` blocks."""
        times = self._times.get((local, place))
        if times is None:
            req, cost = self.req, self.cost
            local_tokens = req.tokens_of(local)
            tokens = self.best_tokens - local_tokens
            times = (cost.prefill_time(req.input_tokens, local_tokens),
                     cost.transfer_time(tokens) if self.holders is None
                     else self.holders.time_to(cost, tokens, place))
            self._times[local, place] = times
        return times

    def option_of(self, p: PrefillState, position: int = -1) -> Option:
        """The instance's option: recompute, or fetch when that is faster."""
        req, now, weight = self.req, self.now, self.weight
        iid = p.iid
        local = int(self.local_view[iid])
        recompute, transfer = self.times_of(local, 0 if self.holders is None else p.place)
        prio = req.arrival + weight * recompute
        if local > self.stored[iid] and p.queue:
            # reusing blocks a queued prefill will write: never jump ahead of it
            prio = max(prio, max(q.priority for q in p.queue) + _AFTER)
        if weight:
            queue = p.wait_time(now, prio)
        else:  # FIFO: what runs plus what is queued
            queue = (p.busy_until - now if p.busy_until > now else 0.0) + p.queued_work_s
        option = Option(iid, local, 0, queue, 0.0, recompute, prio, position)
        best_len = self.best_len
        if best_len > local and self.best_src != iid:
            f_prio = self.fetch_priority
            f_queue = p.wait_time(now, f_prio) if weight else queue
            f_transfer = max(0.0, transfer - f_queue) if self.overlap else transfer
            fetched = Option(iid, local, best_len - local, f_queue, f_transfer,
                             self.fetch_prefill, f_prio, position)
            if fetched.ttft_s < option.ttft_s:
                option = fetched
        return option

    def source_for(self, local: int, place: int) -> int | None:
        """Where a fetch to an instance at ``place`` holding ``local`` blocks comes from:
        the longest prefix's holder, or with an active topology the nearest one."""
        if self.holders is None:
            return self.best_src
        return self.holders.source_for(self.cost, self.best_tokens - self.req.tokens_of(local),
                                       place)
