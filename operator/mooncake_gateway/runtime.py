"""What the gateway knows about one model's engines, and the in-flight accounting.

One :class:`ModelRuntime` per served model holds the Conductor, a
:class:`~mooncake_conductor.state.ClusterState` (prefill instance ``i`` is index id
``i``), the KV-event subscriptions feeding the index, and the instances' health and
scraped metrics. It is composed of one object per job, each built once here with the
per-model state it shares:

- :class:`~.liveconfig.LiveConfig`: the settings now, the Conductor built from them,
  the clock (a reconfigure swaps settings and Conductor inside it);
- :class:`~.membership.Membership`: instances, registration, revision pairing, KV events;
- :class:`~.prefillqueues.PrefillQueues`: the placed prefills, their drain, late
  binding's turns and steals;
- :class:`~.engineload.EngineLoad`: decode batches, the engines' scrapes, peers' load;
- :class:`~.reports.Reports`: the state, registry and hot-prefix reports, the gauges.

Load = this gateway's own in-flight accounting (prefill queue / decode batch updated on
dispatch and completion) plus what the engines' ``/metrics`` say (waiting requests,
KV capacity, prefix-cache hits).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from mooncake_conductor.blockkeys import namespace_seed
from mooncake_conductor.cost import CostModel
from mooncake_conductor.engine import Conductor
from mooncake_conductor.index import PrefixIndex
from mooncake_conductor.peerload import PeerLoads
from mooncake_conductor.state import ClusterState, RequestInfo

from .engineload import EngineLoad
from .hottokens import HotPrefixTokens
from .instances import Instance
from .kvindex import IndexFeeder
from .liveconfig import LiveConfig
from .membership import Membership
from .metrics import GatewayMetrics, ModelMetrics
from .prefillqueues import PrefillQueues
from .reports import Reports, TokenCounters
from .settings import GatewaySettings, ModelSettings, Role
from .slo import SloCounter


class ModelRuntime:
    def __init__(self, cfg: ModelSettings, gw: GatewaySettings, metrics: GatewayMetrics,
                 source: str | None = None,
                 on_join: Callable[[ModelRuntime, Instance], None] | None = None) -> None:
        """``on_join``: called with this runtime and each instance that joins (the
        gateway checks its health at once)."""
        self.gw = gw
        self.metrics = metrics
        self.counters = TokenCounters()
        self.m = ModelMetrics(metrics, cfg.name)
        for role in Role:  # 0 until instances register
            metrics.routable.labels(cfg.name, role.value).set(0)
        self.live = LiveConfig(cfg, gw, source)
        self.slo = SloCounter(metrics.slo_requests, cfg.name, cfg.conductor.slo.ttft_s,
                              cfg.conductor.slo.tbt_s, self.time_scale)
        self.seed = namespace_seed(cfg.name, cfg.block_size, cfg.lora_name, cfg.cache_salt)
        self.index = PrefixIndex(cfg.index_capacity_blocks)
        self.cluster = ClusterState(prefill=[], decode=[], index=self.index)
        # decode engines' caches (what a request sent straight to decode would reuse)
        self.decode_index = PrefixIndex(cfg.index_capacity_blocks)
        self.members = Membership(
            self.live, gw, metrics, self.m, self.cluster,
            IndexFeeder(self.index, cfg.block_size, self.seed),
            IndexFeeder(self.decode_index, cfg.block_size, self.seed),
            None if on_join is None else functools.partial(on_join, self))
        self.decisions: deque[dict[str, Any]] = deque(maxlen=gw.decisions_kept)
        self._rid = 0
        #: the other gateway replicas' in-flight load on these engines (peers.py)
        self.peers = PeerLoads(gw.peers.stale_s)
        self.queues = PrefillQueues(self.live, gw, metrics, self.m, self.members,
                                    self.cluster, self.index)
        self.load = EngineLoad(self.live, self.cluster, self.index, self.decode_index,
                               self.peers, self.queues)
        self.reports = Reports(self.live, self.members, self.queues, self.cluster, self.index,
                               self.decode_index, self.peers, self.seed, self.counters)

    # -- settings (LiveConfig) -------------------------------------------------------------
    @property
    def cfg(self) -> ModelSettings:
        return self.live.cfg

    @property
    def conductor(self) -> Conductor:
        return self.live.conductor

    @property
    def cost(self) -> CostModel:
        return self.live.cost

    @property
    def hot_tokens(self) -> HotPrefixTokens:
        return self.live.hot_tokens

    @property
    def time_scale(self) -> float:
        """Wall seconds per modelled second of this model's engines."""
        return self.live.time_scale

    @property
    def source(self) -> str | None:
        """Where the model's settings come from: a ConfigMap (namespace/name), or None for
        the gateway's own settings."""
        return self.live.source

    @source.setter
    def source(self, source: str | None) -> None:
        self.live.source = source

    def can_swap(self, cfg: ModelSettings) -> bool:
        return self.live.can_swap(cfg)

    def reconfigure(self, cfg: ModelSettings) -> None:
        """A new Conductor over the same state (:meth:`LiveConfig.reconfigure`)."""
        self.live.reconfigure(cfg)
        self.members.refresh()  # places are the new Conductor's (its topology may differ)

    # -- clock -----------------------------------------------------------------------------
    def now(self) -> float:
        """The Conductor's clock: modelled seconds (wall / time_scale)."""
        return self.live.now()

    def next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def request_info(
        self, n_tokens: int, keys: npt.NDArray[np.uint64], max_tokens: int
    ) -> RequestInfo:
        """The scheduler's view of a request; ``keys`` as
        :func:`~mooncake_conductor.blockkeys.block_keys_array` gives them (matching
        uses the array as is)."""
        return RequestInfo(
            rid=self.next_rid(), arrival=self.now(), input_tokens=n_tokens,
            output_tokens=max_tokens, keys=keys.tolist(), block_tokens=self.cfg.block_size,
            key_array=keys,
        )

    # -- membership (Membership) -----------------------------------------------------------
    @property
    def prefill(self) -> list[Instance]:
        return self.members.prefill

    @property
    def decode(self) -> list[Instance]:
        return self.members.decode

    async def start(self) -> None:
        await self.members.start()

    async def close(self, keep: ModelRuntime | None = None) -> None:
        """Stop following the endpoints; ``keep``: the runtime replacing this one
        (:meth:`Membership.close`)."""
        await self.members.close(None if keep is None else keep.members)
