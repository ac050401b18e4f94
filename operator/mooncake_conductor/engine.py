"""The Conductor: one call per request, policy + decode selection + admission.

``Conductor.schedule`` is what the gateway calls in-process and what the
simulator calls on every arrival. It asks the configured prefill policy for a
placement, the decode selector for a decode instance, and — for policies
with admission (paper §4: "reject at once") — turns predicted SLO misses into
a rejection with a reason, which the gateway maps to HTTP 429. Where the policy
sheds load too (:mod:`.shedding`), a request that would push more work out than
it is worth under saturation is rejected as ``overload``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .admission import AdmissionConfig, create_admission
from .calibration import IDLE_CONTEXT_TOKENS, DecodeCalibrationConfig, LogScale, idle_cap
from .candidates import CandidatesConfig
from .capabilities import Capabilities, Overrides, compose
from .cost import CostModel, CostModelConfig
from .decode import DECODE_SELECTORS, DecodeChoice, create_decode_selector
from .holding import HoldingConfig, hold_deadline
from .overrun import OverrunConfig, OverrunEstimator
from .policies.base import Placement, PolicyContext, SLOConfig
from .policies.registry import create_policy, policy_class
from .replication import HotPrefixTracker, ReplicationAction, ReplicationConfig
from .shedding import OverloadShedding, SheddingConfig
from .state import ClusterState, PrefillState, RequestInfo, board_of
from .stealing import Steal, StealingConfig, WorkStealing
from .topology import Topology, TopologyConfig

_NO_ROWS: npt.NDArray[np.intp] = np.empty(0, dtype=np.intp)


class CalibrationConfig(BaseModel):
    """Online calibration of the prefill-time model from observed prefill durations.

    The log of the ratio observed / predicted is tracked with an exponentially weighted
    mean (``rate`` per observation), and every prediction is scaled by its exponential:
    a systematic error (the real MFU off the configured one, another GPU) is learnt in
    a few dozen prefills, while per-request noise averages out (log-normal noise of
    sigma s leaves a jitter of about ``s * sqrt(rate / 2)``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rate: float = Field(0.05, gt=0, le=1, description="weight of each new observation")
    min_scale: float = Field(0.25, gt=0, description="the scale is kept at or above this")
    max_scale: float = Field(4.0, gt=0, description="the scale is kept at or below this")
    initial_scale: float = Field(
        1.0, gt=0, description="the prefill scale to start from (e.g. one learnt before); "
        "applies with calibration off too")

    @model_validator(mode="after")
    def _scale_bounds(self) -> CalibrationConfig:
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError("initial_scale must lie within [min_scale, max_scale]")
        return self


class ConductorConfig(BaseModel):
    """Scheduler configuration: a policy by name with its parameters, SLOs, cost model."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "conductor"
    params: dict[str, Any] = Field(default_factory=dict)
    decode_selector: str | None = Field(None, description="default: the policy's own")
    admission: bool | None = Field(None, description="default: the policy's own")
    admission_rule: AdmissionConfig = Field(
        AdmissionConfig(), description="with admission on, the rule that refuses a request "
        "for its TTFT SLO (mooncake_conductor.admission)")
    shedding: SheddingConfig = SheddingConfig()
    stealing: StealingConfig = StealingConfig()
    holding: HoldingConfig = HoldingConfig()
    slo: SLOConfig = SLOConfig()
    replication: ReplicationConfig = ReplicationConfig()
    replicate: bool | None = Field(None, description="default: the policy's own")
    cost: CostModelConfig = CostModelConfig()
    calibrate: bool | None = Field(
        None, description="learn the prefill-time scale online (default: the policy's own)")
    calibration: CalibrationConfig = CalibrationConfig()
    decode_calibration: DecodeCalibrationConfig = Field(
        DecodeCalibrationConfig(), description="learn the decode-step scale from the TBT "
        "finished streams got (mooncake_conductor.calibration; off: the simulator's "
        "engines are the model)")
    overrun: OverrunConfig = OverrunConfig()
    candidates: CandidatesConfig = CandidatesConfig()
    topology: TopologyConfig = Field(
        TopologyConfig(), description="the fleet's link levels (none: flat) and whether "
        "decisions use them (docs/topology.md)")
    routing_only: bool = Field(
        False, description="equal capability: every policy routes on local caches only "
        "(no KV fetch, no CPP, no admission, no replication), to compare routing alone")
    seed: int = 0

    @model_validator(mode="after")
    def _known_policy_and_params(self) -> ConductorConfig:
        try:
            cls = policy_class(self.policy)
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        cls.Params.model_validate(self.params)  # field-level errors surface here
        if self.decode_selector is not None and self.decode_selector not in DECODE_SELECTORS:
            known = ", ".join(sorted(DECODE_SELECTORS))
            raise ValueError(f"unknown decode selector {self.decode_selector!r}; known: {known}")
        return self

    def decode_name(self) -> str:
        """The decode selector in force: as set, else the policy's own."""
        return self.decode_selector or policy_class(self.policy).default_decode

    def capabilities(self) -> Capabilities:
        """What a Conductor of this configuration does beyond placing: each switch set
        here, else the policy's own (:mod:`.capabilities`)."""
        cls = policy_class(self.policy)
        decode = DECODE_SELECTORS[self.decode_name()]
        return compose(
            cls.capabilities,
            Overrides(admission=self.admission, shedding=self.shedding.enabled,
                      stealing=self.stealing.enabled, holding=self.holding.enabled,
                      replication=self.replicate, calibration=self.calibrate,
                      reestimation=self.overrun.enabled),
            routing_only=self.routing_only, decode_counts_placed=decode.counts_placed)


@dataclass(slots=True)
class Decision:
    placement: Placement
    decode: DecodeChoice

    @property
    def rejected(self) -> bool:
        return self.reject_reason is not None

    @property
    def reject_reason(self) -> str | None:
        return self.placement.reject_reason or self.decode.reject_reason


class Conductor:
    def __init__(self, config: ConductorConfig | None = None, cost: CostModel | None = None):
        self.config = config or ConductorConfig()
        self.cost = cost or CostModel(self.config.cost)
        self.rng = random.Random(self.config.seed)
        #: the fleet's places and links; states carry ``place`` ids from its
        #: :meth:`~.topology.Topology.place_id`
        self.topology = Topology(self.config.topology)
        only = self.config.routing_only
        ctx = PolicyContext(cost=self.cost, slo=self.config.slo, rng=self.rng,
                            fetch=not only, cpp=not only, candidates=self.config.candidates,
                            topology=self.topology)
        self.policy = create_policy(self.config.policy, ctx, self.config.params)
        self.decode_selector = create_decode_selector(
            self.config.decode_name(), self.cost, self.config.slo.tbt_s, self.rng,
            self.config.candidates)
        self.decode_selector.topology = self.topology
        cfg = self.config
        #: what this Conductor does beyond placing, composed once (:mod:`.capabilities`)
        self.capabilities = caps = cfg.capabilities()
        self.admission_rule = create_admission(cfg.admission_rule, cfg.slo)
        self.shedding = (OverloadShedding(cfg.shedding, cfg.slo.ttft_s)
                         if caps.shedding else None)
        self.stealing = (WorkStealing(cfg.stealing, self.cost, self.topology)
                         if caps.stealing else None)
        self.hot = HotPrefixTracker(cfg.replication)
        self.overrun = OverrunEstimator(cfg.overrun) if caps.reestimation else None
        #: prefills reported through :meth:`observe_prefill`
        self.observed_prefills = 0
        dc = self.config.decode_calibration
        cap = idle_cap(self.cost.decode_step_time(1, IDLE_CONTEXT_TOKENS),
                       self.config.slo.tbt_s, dc.idle_share)
        self.decode_scale = LogScale(dc.rate, dc.min_scale, min(dc.max_scale, cap))
        cal = self.config.calibration
        self.prefill_scale = LogScale(cal.rate, cal.min_scale, cal.max_scale,
                                      cal.initial_scale)
        if self.prefill_scale.log:
            self.cost.set_prefill_scale(cal.initial_scale)

    def observe_prefill(self, predicted_s: float, observed_s: float) -> None:
        """A prefill predicted to take ``predicted_s`` (by the current model) took
        ``observed_s``: with calibration on, move the model's prefill scale towards it;
        with overrun re-estimation on, measure the prediction error's spread."""
        self.observed_prefills += 1
        if self.overrun is not None:
            self.overrun.observe(predicted_s, observed_s)
        self.admission_rule.observe(predicted_s, observed_s)
        if self.capabilities.calibration and self.prefill_scale.observe(predicted_s, observed_s):
            self.cost.set_prefill_scale(self.prefill_scale.scale)

    def observe_decode(self, predicted_tbt_s: float, observed_tbt_s: float,
                       intervals: int) -> None:
        """A stream predicted a TBT of ``predicted_tbt_s`` (by the current model) got
        ``observed_tbt_s`` over ``intervals`` token intervals: with decode calibration
        on, move the model's decode-step scale towards it (:mod:`.calibration`)."""
        dc = self.config.decode_calibration
        if not dc.enabled or intervals < dc.min_intervals:
            return
        if self.decode_scale.observe(predicted_tbt_s, observed_tbt_s):
            self.cost.set_decode_scale(self.decode_scale.scale)

    def overdue_until(self, now: float, started: float, predicted_s: float) -> float | None:
        """A prefill that started at ``started``, predicted to take ``predicted_s``, is still
        running at ``now`` (past its predicted end): the instance's new busy-until time
        (:mod:`.overrun`), or ``None`` when re-estimation is off (the instance then counts
        as free, the paper's reading of T_queue)."""
        if self.overrun is None:
            return None
        return self.overrun.busy_until(now, started, predicted_s)

    def schedule(self, req: RequestInfo, cluster: ClusterState, now: float) -> Decision:
        # every state in group 0 (the usual case): one class-attribute read
        if PrefillState.nonzero_groups and cluster.grouped():
            placement, decode = self._choose_grouped(req, cluster, now)
        else:
            placement = self.policy.choose(req, cluster, now)
            decode = self.decode_selector.choose_near(
                req, cluster.decode, self._prefill_place(placement, cluster))
        if self.capabilities.admission:
            waited = now - req.arrival if now > req.arrival else 0.0  # held requests waited
            if (placement.reject_reason is None and self.admission_rule.breaks_ttft(
                    placement, cluster, now, waited)):
                placement.reject_reason = "ttft-slo"
            if (self.shedding is not None and placement.reject_reason is None
                    and not self.shedding.admit(placement.queue_s, placement.gpu_seconds)):
                placement.reject_reason = "overload"
        else:
            # without admission a predicted TBT miss still decodes on the best instance
            if decode.reject_reason == "tbt-slo":
                decode.reject_reason = None
        decision = Decision(placement, decode)
        if not decision.rejected:
            self.decode_selector.placed(req, decode.decode)
            self.policy.on_placed(req, placement, cluster)
            self.hot.record(req.keys, now, placement.reused_blocks, req.key_array)
        return decision

    def hold_until(self, req: RequestInfo, decision: Decision, now: float) -> float | None:
        """For a request ``decision`` refused only for decode room (``tbt-slo``), with
        holding on: the time until which it may wait for room (:mod:`.holding`), if that
        is later than ``now``; else ``None`` (the refusal stands)."""
        pl = decision.placement
        if (not self.capabilities.holding or pl.reject_reason is not None
                or decision.decode.reject_reason != "tbt-slo"):
            return None
        until = hold_deadline(req.arrival, self.config.slo.ttft_s, pl.prefill_s, pl.transfer_s)
        return until if until > now else None

    def steal(
        self, idle: PrefillState, cluster: ClusterState,
        request_of: Callable[[int], RequestInfo], now: float,
        movable: Callable[[int], bool],
    ) -> Steal | None:
        """A prompt queued on another instance for ``idle`` (just gone idle) to take now,
        or ``None`` (always, unless work stealing is on)."""
        if self.stealing is None:
            return None
        return self.stealing.pick(idle, cluster, request_of, now, movable)

    def take(self, steal: Steal, req: RequestInfo, old: Placement,
             cluster: ClusterState) -> None:
        """Carry out ``steal`` of ``req`` (placed at ``old``): its queue entry and its
        pending blocks leave the victim for the idle instance, where it keeps its
        priority and weighs the new placement's work, and the policy's books follow
        (:meth:`moved`). Callers keep their own books (in-flight counts, fetches)."""
        pl = steal.placement
        assert pl.prefill is not None
        item = cluster.prefill[steal.victim].pop(steal.rid)
        cluster.index.remove_pending(steal.victim, req.keys)
        cluster.index.add_pending(pl.prefill, req.keys)
        self.moved(req, old, pl, cluster)
        cluster.prefill[pl.prefill].enqueue(steal.rid, item.priority, pl.prefill_s + pl.transfer_s,
                                            item.blocks, item.tokens)

    def moved(self, req: RequestInfo, old: Placement, new: Placement,
              cluster: ClusterState) -> None:
        """A queued prefill moved from ``old`` to ``new`` (a steal): policies that count
        their own in-flight work release it where it was and count it where it went."""
        self.policy.on_finished(req, old)
        self.policy.on_placed(req, new, cluster)

    def prefilled(self, req: RequestInfo, decision: Decision) -> None:
        """A scheduled request's prefill is done (its first token)."""
        if not decision.rejected:
            self.decode_selector.joined(req)
            self.policy.on_prefilled(req, decision.placement)

    def decoding(self, req: RequestInfo, decision: Decision) -> None:
        """A scheduled request starts on its decode instance without a prefill instance
        (the gateway's direct rule): it is in that instance's batch from now on."""
        if not decision.rejected:
            self.decode_selector.joined(req)

    def finished(self, req: RequestInfo, decision: Decision) -> None:
        """A scheduled request is done (served or failed): policies that count their
        own outstanding requests release it. Rejected requests were never counted."""
        if not decision.rejected:
            self.decode_selector.joined(req)  # a prefill that failed never joins
            self.policy.on_finished(req, decision.placement)

    def _choose_grouped(
        self, req: RequestInfo, cluster: ClusterState, now: float
    ) -> tuple[Placement, DecodeChoice]:
        """Prefill and decode of one group (the instances up span several): prefill
        instances of a group with no decode instance up are left out, and the decode
        instance is chosen among those of the chosen prefill instance's group. The
        states are marked down only for the calls and restored with their boards'
        caches (the compiled rankings read the boards)."""
        pboard, dboard = board_of(cluster.prefill), board_of(cluster.decode)
        pup, pgroup = pboard["up"], pboard["group"]
        with_decode = dboard.live_groups
        orphans = _NO_ROWS
        if not pboard.live_groups <= with_decode:
            orphans = np.flatnonzero(pup & ~np.isin(pgroup, tuple(with_decode)))
        undo = pboard.take_down(orphans)
        try:
            placement = self.policy.choose(req, cluster, now)
            if placement.prefill is not None and len(placement.cpp_group) > 1:
                group = int(pgroup[pboard.row_of(placement.prefill)])
                if any(pgroup[pboard.row_of(i)] != group for i in placement.cpp_group):
                    # a pipeline group across engine groups: again within the leader's
                    again = pboard.take_down(np.flatnonzero(pup & (pgroup != group)))
                    try:
                        placement = self.policy.choose(req, cluster, now)
                    finally:
                        again()
        finally:
            undo()
        if placement.prefill is None:  # the prefill side's rejection decides
            return placement, self.decode_selector.choose(req, cluster.decode)
        group = int(pgroup[pboard.row_of(placement.prefill)])
        undo = dboard.take_down(dboard.rows_outside(group))
        try:
            decode = self.decode_selector.choose_near(
                req, cluster.decode, self._prefill_place(placement, cluster))
        finally:
            undo()
        return placement, decode

    def _prefill_place(self, placement: Placement, cluster: ClusterState) -> int:
        """The place the KV of ``placement`` streams to decode from (its instance, a CPP
        group's leader); 0 (unknown) when decisions ignore the topology."""
        if placement.prefill is None or not self.topology.active:
            return 0
        board = board_of(cluster.prefill)
        row = board.row_of(placement.prefill)
        return int(board["place"][row]) if row >= 0 else 0

    def plan_replication(self, cluster: ClusterState, now: float) -> list[ReplicationAction]:
        """Hot-prefix copies to make now (empty unless replication is on)."""
        if not self.capabilities.replication:
            return []
        return self.hot.plan(cluster, now)
