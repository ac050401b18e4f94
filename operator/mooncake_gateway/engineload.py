"""The load on one model's engines besides this gateway's prefill queues: its decode
batches (and the requests held until a decode request ends), the decode calibration,
what the engines' ``/metrics`` say (waiting requests, KV capacity) and the other gateway
replicas' in-flight load on the same engines.
"""

from __future__ import annotations

import asyncio
import logging

from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.peerload import LoadReport, PeerLoads, own_report
from mooncake_conductor.state import ClusterState, RequestInfo

from .instances import EngineStats, Instance
from .liveconfig import LiveConfig
from .prefillqueues import PrefillQueues
from .settings import Role
from .slo import request_tbt

log = logging.getLogger(__name__)


class EngineLoad:
    def __init__(self, live: LiveConfig, cluster: ClusterState, index: PrefixIndex,
                 decode_index: PrefixIndex, peers: PeerLoads, queues: PrefillQueues) -> None:
        self.live = live
        self.cluster = cluster
        self.index = index
        self.decode_index = decode_index
        #: the other gateway replicas' in-flight load on these engines (peers.py)
        self.peers = peers
        self.queues = queues
        #: set (and replaced) whenever a decode request ends: held requests wait on it
        self._decode_room: asyncio.Event | None = None  # made by the first waiter

    # -- scraped metrics -------------------------------------------------------------------
    def apply_stats(self, inst: Instance, stats: EngineStats) -> None:
        inst.stats = stats
        if stats.block_size is not None and stats.block_size != self.live.cfg.block_size:
            log.warning("%s reports block size %s, configured %s: the index cannot match",
                        inst.name, stats.block_size, self.live.cfg.block_size)
        if inst.role is Role.PREFILL:
            if stats.num_gpu_blocks:
                p = self.cluster.prefill[inst.iid]
                p.cache_capacity_tokens = stats.num_gpu_blocks * self.live.cfg.block_size
                if self.index.capacity(inst.iid) != stats.num_gpu_blocks:
                    self.index.add_instance(inst.iid, stats.num_gpu_blocks)
        else:
            d = self.cluster.decode[inst.iid]
            d.waiting = int(stats.waiting)
            if stats.num_gpu_blocks and self.decode_index.capacity(inst.iid) != \
                    stats.num_gpu_blocks:
                self.decode_index.add_instance(inst.iid, stats.num_gpu_blocks)
            if stats.num_gpu_blocks:
                d.capacity_tokens = stats.num_gpu_blocks * self.live.cfg.block_size

    # -- decode batches --------------------------------------------------------------------
    def decode_observed(self, predicted_tbt_s: float, intervals_wall_s: list[float]) -> None:
        """A stream relayed to its end: its TBT (the mean of its longest tenth of token
        intervals, in modelled seconds) against the decode selector's prediction, for the
        Conductor's decode calibration (:mod:`mooncake_conductor.calibration`)."""
        if predicted_tbt_s <= 0 or not intervals_wall_s:
            return
        observed = request_tbt(intervals_wall_s) / self.live.time_scale
        self.live.conductor.observe_decode(predicted_tbt_s, observed, len(intervals_wall_s))

    def decode_started(self, inst: Instance, req: RequestInfo) -> None:
        d = self.cluster.decode[inst.iid]
        d.batch += 1
        d.context_tokens += req.input_tokens
        d.reserved_tokens += req.output_tokens
        inst.inflight += 1

    def decode_done(self, inst: Instance, req: RequestInfo) -> None:
        d = self.cluster.decode[inst.iid]
        d.batch = max(0, d.batch - 1)
        d.context_tokens = max(0, d.context_tokens - req.input_tokens)
        d.reserved_tokens = max(0, d.reserved_tokens - req.output_tokens)
        inst.inflight -= 1
        room, self._decode_room = self._decode_room, None
        if room is not None:
            room.set()  # every request held for room tries again, oldest first

    async def wait_decode_room(self, timeout_s: float) -> bool:
        """Wait until a decode request ends (then ``True``) or ``timeout_s`` wall seconds
        pass (``False``)."""
        room = self._decode_room
        if room is None:
            room = self._decode_room = asyncio.Event()
        try:
            await asyncio.wait_for(room.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    # -- replicas ----------------------------------------------------------------------------
    def load_report(self) -> LoadReport:
        """This replica's own in-flight load, for the other replicas (peers.py)."""
        self.queues.drain(self.live.now())
        return own_report(self.cluster)

    def peer_gone(self, peer: str) -> None:
        """A peer is gone: its load leaves the view at once, not when it turns stale."""
        self.peers.forget(peer)
        self.apply_peers()

    def apply_peers(self) -> None:
        """Fold the fresh peers' load into the cluster state (stale reports count 0)."""
        now = self.live.now()
        self.queues.drain(now)
        self.peers.apply(self.cluster, now)
