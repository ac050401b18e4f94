"""Decode-instance selection, one small rule per name.

- ``random`` / ``round-robin``: ignore load (baselines).
- ``least-load``: the smallest batch, then the least KV in use, ties at random.
- ``tbt-slo`` (paper §4, decode side of Algorithm 1): predict each instance's
  step time with this request added (cost model, continuous batching); keep
  those under the TBT SLO with KV room for the whole request; take the one
  with the smallest predicted step. None left means the request would break
  its TBT SLO: the Conductor rejects it (429).
- ``aibrix``: AIBrix's estimate ``(1000/throughput) * (1 + 1/max(running,1))``
  ms, x1.5 past 90% KV use; smallest wins.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from .cost import CostModel
from .policies.base import least, least_item
from .state import DecodeState, RequestInfo

_TIE_EPS = 1e-12  # absolute tie slack of :func:`~.policies.base.least`


@dataclass(slots=True)
class DecodeChoice:
    decode: int | None
    predicted_tbt_s: float = 0.0
    reject_reason: str | None = None


class DecodeSelector(ABC):
    name: ClassVar[str] = ""

    def __init__(self, cost: CostModel, tbt_slo_s: float, rng: random.Random) -> None:
        self.cost = cost
        self.tbt_slo_s = tbt_slo_s
        self.rng = rng

    @abstractmethod
    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice: ...

    def predicted_step(self, req: RequestInfo, d: DecodeState) -> float:
        return self.cost.decode_step_time(d.batch + 1, d.context_tokens + req.input_tokens)


class RandomDecode(DecodeSelector):
    name = "random"

    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice:
        live = [d for d in decode if d.up]
        if not live:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        d = self.rng.choice(live)
        return DecodeChoice(d.iid, self.predicted_step(req, d))


class RoundRobinDecode(DecodeSelector):
    name = "round-robin"

    def __init__(self, cost: CostModel, tbt_slo_s: float, rng: random.Random) -> None:
        super().__init__(cost, tbt_slo_s, rng)
        self._next = 0

    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice:
        live = [d for d in decode if d.up]
        if not live:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        d = live[self._next % len(live)]
        self._next += 1
        return DecodeChoice(d.iid, self.predicted_step(req, d))


class LeastLoadDecode(DecodeSelector):
    name = "least-load"

    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice:
        live = [d for d in decode if d.up]
        if not live:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        # kv_usage < 1 only breaks ties between equal batch sizes
        iid = least([(d.batch + d.waiting + d.kv_usage, d.iid) for d in live], self.rng)
        d = next(x for x in live if x.iid == iid)
        return DecodeChoice(iid, self.predicted_step(req, d))


class TBTSLODecode(DecodeSelector):
    """Smallest predicted step among instances within the TBT SLO with KV room.

    Instances are priced lazily: a step is never below
    :meth:`~mooncake_conductor.cost.CostModel.decode_step_floor` of the instance's
    context, so after pricing the least-loaded one only those whose floor reaches
    into its tie band can win or tie (the same answer as pricing all of them)."""

    name = "tbt-slo"
    tie_tolerance: ClassVar[float] = 0.01

    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice:
        inp = req.input_tokens
        need = inp + req.output_tokens
        live = [d for d in decode if d.up]
        if not live:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        step_time = self.cost.decode_step_time
        slo = self.tbt_slo_s
        # (context, batch, reserved, capacity) of every live instance, in list order
        loads = [(d.context_tokens, d.batch, d.reserved_tokens, d.capacity_tokens)
                 for d in live]
        ctx, batch, reserved, capacity = min(loads)
        first = step_time(batch + 1, ctx + inp)
        first_ok = first <= slo and (capacity <= 0 or ctx + reserved + need <= capacity)
        if loads.count(loads[0]) == len(loads):  # all alike (an idle pool): all tie
            if not first_ok:
                return DecodeChoice(live[0].iid, first, reject_reason="tbt-slo")
            options = [(first, d.iid) for d in live]
        else:
            states = [(*load, d.iid) for load, d in zip(loads, live, strict=True)]
            if first_ok:  # past ``bound`` context even the floor is outside the tie band
                bound = self.cost.decode_context_within(
                    first + abs(first) * self.tie_tolerance + _TIE_EPS) - inp
                states = [s for s in states if s[0] <= bound]
            # equal loads share one prediction
            steps = {load: step_time(load[1] + 1, load[0] + inp)
                     for load in {(s[0], s[1]) for s in states}}
            options = [(steps[(c, b)], iid) for c, b, r, cap, iid in states
                       if steps[(c, b)] <= slo and (cap <= 0 or c + r + need <= cap)]
            if not options:
                best = min(states, key=lambda s: steps[(s[0], s[1])])  # first of the fastest
                return DecodeChoice(best[4], steps[(best[0], best[1])],
                                    reject_reason="tbt-slo")
        step, iid = least_item(options, self.rng, rel_tol=self.tie_tolerance)
        return DecodeChoice(iid, step)


class AIBrixDecode(DecodeSelector):
    name = "aibrix"
    kv_full: ClassVar[float] = 0.9
    kv_full_penalty: ClassVar[float] = 1.5

    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice:
        live = [d for d in decode if d.up]
        if not live:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        est: list[tuple[float, int]] = []
        for d in live:
            tps = d.tokens_per_s or 1.0 / max(1e-9, self.cost.decode_step_time(1, req.input_tokens))
            ms = (1000.0 / tps) * (1.0 + 1.0 / max(d.batch, 1))
            if d.kv_usage > self.kv_full:
                ms *= self.kv_full_penalty
            est.append((ms, d.iid))
        iid = least(est, self.rng)
        d = next(x for x in live if x.iid == iid)
        return DecodeChoice(iid, self.predicted_step(req, d))


DECODE_SELECTORS: dict[str, type[DecodeSelector]] = {
    cls.name: cls for cls in (RandomDecode, RoundRobinDecode, LeastLoadDecode, TBTSLODecode,
                              AIBrixDecode)
}


def create_decode_selector(
    name: str, cost: CostModel, tbt_slo_s: float, rng: random.Random
) -> DecodeSelector:
    try:
        cls = DECODE_SELECTORS[name]
    except KeyError:
        raise KeyError(
            f"unknown decode selector {name!r}; known: {', '.join(sorted(DECODE_SELECTORS))}"
        ) from None
    return cls(cost, tbt_slo_s, rng)
