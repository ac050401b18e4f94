"""A model's settings as they are now, and what is built from them.

One :class:`LiveConfig` per model runtime holds the model's settings and where they come
from, the Conductor built from them (and its cost model), the hot-prefix token keeper
and the model's clock. A reconfigure replaces settings and Conductor here, in place:
the runtime's parts all hold this one object, so each sees the new ones at once.
"""

from __future__ import annotations

import time

from mooncake_conductor.engine import Conductor, ConductorConfig

from .handshake import handshake
from .hottokens import HotPrefixTokens
from .settings import GatewaySettings, ModelSettings

#: settings of a model that can change without a new runtime (index, keys, membership
#: untouched): the Conductor is rebuilt, the rest is read per request
SWAPPABLE_FIELDS = frozenset({"conductor", "direct", "max_model_len", "default_max_tokens"})


def late_binding(cfg: ModelSettings, gw: GatewaySettings) -> bool:
    """Whether this gateway can hold prefills for their turn, so that an idle instance may
    take one (:mod:`.prefillqueues`): a dispatch depth set, and a handshake that does not
    send both halves at once (its decode engine already waits for the prefill engine it
    was told of)."""
    return gw.prefill_dispatch_depth > 0 and not handshake(cfg.handshake).concurrent


def conductor_config(cfg: ModelSettings, gw: GatewaySettings) -> ConductorConfig:
    """The Conductor settings the gateway runs for ``cfg``: the model's, with work
    stealing off where the gateway cannot steal (no :func:`late_binding`), and the
    admission margin's error taken as what the gateway measures: a whole
    placement-to-answer time against the predicted TTFT (``error_of="ttft"``). What the
    Conductor reports, and a simulator given these settings, then do what the gateway
    does: every prefill is sent at once, and none is moved (a simulator times each
    prefill on its own, so with a TTFT margin on it is the more cautious there)."""
    c = cfg.conductor
    update: dict[str, object] = {}
    if c.admission_rule.error_of != "ttft":
        update["admission_rule"] = c.admission_rule.model_copy(update={"error_of": "ttft"})
    if not late_binding(cfg, gw) and c.stealing.enabled is not False:
        update["stealing"] = c.stealing.model_copy(update={"enabled": False})
    return c.model_copy(update=update) if update else c


class LiveConfig:
    def __init__(self, cfg: ModelSettings, gw: GatewaySettings,
                 source: str | None = None) -> None:
        self.cfg = cfg
        self.gw = gw
        #: where the model's settings come from: a ConfigMap (namespace/name), or None
        #: for the gateway's own settings
        self.source = source
        #: wall seconds per modelled second of this model's engines
        self.time_scale = cfg.time_scale or gw.time_scale
        self.conductor = Conductor(conductor_config(cfg, self.gw))
        self.cost = self.conductor.cost
        self.hot_tokens = self._hot_tokens()
        self.conductor.hot = self.hot_tokens  # the tracker that also keeps tokens

    def now(self) -> float:
        """The Conductor's clock: modelled seconds (wall / time_scale)."""
        return time.monotonic() / self.time_scale

    def _hot_tokens(self) -> HotPrefixTokens:
        gw = self.gw
        return HotPrefixTokens(self.cfg.conductor.replication, self.cfg.block_size,
                               gw.hot_tokens_rate_share, gw.hot_tokens_prefixes,
                               gw.hot_tokens_max)

    def can_swap(self, cfg: ModelSettings) -> bool:
        """Whether ``cfg`` differs from the current settings only in what
        :meth:`reconfigure` swaps in place."""
        old, new = self.cfg.model_dump(), cfg.model_dump()
        return all(old[k] == new[k] for k in old if k not in SWAPPABLE_FIELDS)

    def reconfigure(self, cfg: ModelSettings) -> None:
        """New policy, SLOs, direct rule or limits: a new Conductor over the same state
        (index, instances, queues, calibration); the hot-prefix history is kept when the
        replication settings are unchanged."""
        old = self.conductor
        self.cfg = cfg
        self.conductor = Conductor(conductor_config(cfg, self.gw))
        self.cost = self.conductor.cost
        if old.config.replication != cfg.conductor.replication:
            self.hot_tokens = self._hot_tokens()
        self.conductor.hot = self.hot_tokens
