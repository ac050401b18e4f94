"""Decode-instance selection, one small rule per name.

- ``random`` / ``round-robin``: ignore load (baselines).
- ``least-load``: the smallest batch, then the least KV in use, ties at random.
- ``tbt-slo`` (paper §4, decode side of Algorithm 1): predict each instance's
  step time with this request added (cost model, continuous batching); keep
  those under the TBT SLO with KV room for the whole request; take the one
  with the smallest predicted step (within 1 %: a tie, drawn at random). None
  left means the request would break its TBT SLO: the Conductor rejects it (429).
- ``tbt-lookahead`` (ours, ``conductor``'s default): ``tbt-slo`` with the requests
  already sent to each instance whose prefill is still running counted in its batch.
- ``aibrix``: AIBrix's estimate ``(1000/throughput) * (1 + 1/max(running,1))``
  ms, x1.5 past 90% KV use; smallest wins.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from .candidates import CandidatesConfig, DecodeOrder, order_of
from .cost import CostModel
from .decode_kernel import rank_decode
from .policies.base import least
from .state import Board, DecodeState, RequestInfo, board_of
from .topology import Topology, narrow_to_nearest

_TIE_EPS = 1e-12  # absolute tie slack of :func:`~.policies.base.least`


@dataclass(slots=True)
class DecodeChoice:
    decode: int | None
    predicted_tbt_s: float = 0.0
    reject_reason: str | None = None


class DecodeSelector(ABC):
    name: ClassVar[str] = ""
    #: whether choices count the requests already placed whose prefill still runs (then
    #: requests released together, e.g. after a hold, do not all see the same free room)
    counts_placed: ClassVar[bool] = False

    def __init__(self, cost: CostModel, tbt_slo_s: float, rng: random.Random) -> None:
        self.cost = cost
        self.tbt_slo_s = tbt_slo_s
        self.rng = rng
        #: the fleet's topology (the Conductor sets its own; None: flat)
        self.topology: Topology | None = None

    @abstractmethod
    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice: ...

    def choose_near(self, req: RequestInfo, decode: list[DecodeState],
                    near: int) -> DecodeChoice:
        """:meth:`choose` for a request whose KV streams from place ``near`` (0: unknown);
        selectors that read the topology prefer instances near it (default: ignore)."""
        return self.choose(req, decode)

    def placed(self, req: RequestInfo, decode: int | None) -> None:  # noqa: B027
        """``req`` was sent to decode instance ``decode`` (its prefill starts)."""

    def joined(self, req: RequestInfo) -> None:  # noqa: B027
        """``req``'s prefill is done (or it failed): it decodes now, or never."""

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
    """Smallest predicted step among instances within the TBT SLO with KV room; steps
    within ``tie_tolerance`` of the best tie (one drawn at random).

    Every live instance is priced in one compiled pass
    (:func:`~mooncake_conductor.decode_kernel.rank_decode`, the cost model's
    :meth:`~mooncake_conductor.cost.CostModel.decode_step_time` operation for
    operation); on a pool of at least ``candidates.min_pool`` instances only the
    ``candidates.least_loaded`` with the smallest step for this request and KV room for
    it (:class:`~mooncake_conductor.candidates.DecodeOrder`)."""

    name = "tbt-slo"
    tie_tolerance: ClassVar[float] = 0.01
    #: with an active topology, instances whose step is within this share of the best
    #: count as near-equal, and the nearest of them to the prefill instance are kept
    near_tolerance: ClassVar[float] = 0.1

    def __init__(self, cost: CostModel, tbt_slo_s: float, rng: random.Random,
                 candidates: CandidatesConfig | None = None) -> None:
        super().__init__(cost, tbt_slo_s, rng)
        self.candidates = candidates or CandidatesConfig()
        self._step = np.empty(0)
        self._ties = np.empty(0, dtype=np.int64)

    def choose(self, req: RequestInfo, decode: list[DecodeState]) -> DecodeChoice:
        return self.choose_near(req, decode, 0)

    def choose_near(self, req: RequestInfo, decode: list[DecodeState],
                    near: int) -> DecodeChoice:
        """With an active topology and a known ``near``: the instances within
        :attr:`near_tolerance` of the best step (and the SLO, with room) are narrowed to
        those whose link from ``near`` is the fastest, then the tie band applies among
        them (:func:`.topology.narrow_to_nearest`)."""
        if not decode:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        topo = self.topology
        local = bool(near) and topo is not None and topo.active
        board = board_of(decode)  # every instance's load, kept current by the states
        m = len(decode)
        if len(self._step) != m:
            self._step, self._ties = np.empty(m), np.empty(m, dtype=np.int64)
        step, ties = self._step, self._ties
        need = req.input_tokens + req.output_tokens
        cand = self.candidates
        ahead_n: npt.NDArray[np.int64] | None
        ahead_tokens: npt.NDArray[np.int64] | None
        if cand.enabled and m >= cand.min_pool and not board.masked:
            order = self._order(board)
            rows = order.candidates(cand.least_loaded, req.input_tokens, need)
            ahead_n, ahead_tokens = order.ahead_n, order.ahead_tokens
        else:
            rows = None
            ahead_n, ahead_tokens = self._ahead(board)
        count, fastest = rank_decode(
            self.cost.decode_array, req.input_tokens, need, self.tbt_slo_s,
            self.near_tolerance if local else self.tie_tolerance,
            _TIE_EPS, board["up"], board["context_tokens"], board["batch"],
            board["reserved_tokens"], board["capacity_tokens"], step, ties, rows,
            ahead_n, ahead_tokens,
        )
        if local and count > 1:
            assert topo is not None
            count = narrow_to_nearest(topo, near, board["place"], step, ties, count,
                                      self.tie_tolerance, _TIE_EPS)
        if fastest < 0:
            return DecodeChoice(None, reject_reason="no-decode-instance")
        if not count:  # nothing meets the SLO with room: the first of the fastest
            return DecodeChoice(decode[fastest].iid, float(step[fastest]),
                                reject_reason="tbt-slo")
        row = int(ties[0] if count == 1 else ties[self.rng.choice(range(count))])
        return DecodeChoice(decode[row].iid, float(step[row]))

    def _order(self, board: Board) -> DecodeOrder:
        consts = self.cost.decode_array.tolist()
        order: DecodeOrder = order_of(board, lambda b: DecodeOrder(b, consts))
        return order

    def _ahead(self, board: Board) -> tuple[npt.NDArray[np.int64] | None,
                                            npt.NDArray[np.int64] | None]:
        """Requests sent ahead to each row (none for the plain rule)."""
        return None, None


class TBTLookaheadDecode(TBTSLODecode):
    """``tbt-slo`` priced on the batch the request will decode in, not the one running now.

    Each instance's step is predicted with the requests already sent to it whose prefill
    has not finished added to its batch and their prompts to its context: they join
    before or with this one. Rule as ``tbt-slo`` otherwise. The paper's check (§4)
    prices the running batch only, so a burst of admissions all see the same short
    batch, pile onto one instance and break the TBT SLO after admission (our finding on
    a decode-bound workload: TBT p99 276 ms against a 100 ms SLO, 54 ms with the
    look-ahead). Pricing the growth of running contexts too bought nothing there."""

    name = "tbt-lookahead"
    counts_placed = True

    def __init__(self, cost: CostModel, tbt_slo_s: float, rng: random.Random,
                 candidates: CandidatesConfig | None = None) -> None:
        super().__init__(cost, tbt_slo_s, rng, candidates)
        #: request id -> (decode iid, KV tokens it will hold) until its prefill is done
        self._pending: dict[int, tuple[int, int]] = {}
        self._count: dict[int, int] = {}
        self._tokens: dict[int, int] = {}
        self._ordered: Board | None = None  # the board whose order counts them too
        #: the board of the last full pass and, by its rows, the requests and prompt
        #: tokens sent ahead (:meth:`_ahead`), kept current by :meth:`_tell`
        self._by_row: tuple[Board, npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None

    def placed(self, req: RequestInfo, decode: int | None) -> None:
        if decode is None or req.rid in self._pending:
            return
        need = req.input_tokens
        self._pending[req.rid] = (decode, need)
        self._count[decode] = self._count.get(decode, 0) + 1
        self._tokens[decode] = self._tokens.get(decode, 0) + need
        self._tell(decode, 1, need)

    def joined(self, req: RequestInfo) -> None:
        got = self._pending.pop(req.rid, None)
        if got is None:
            return
        iid, need = got
        self._count[iid] -= 1
        self._tokens[iid] -= need
        if not self._count[iid]:
            del self._count[iid], self._tokens[iid]
        self._tell(iid, -1, -need)

    def _tell(self, iid: int, requests: int, tokens: int) -> None:
        """Keep the full pass's arrays and the large pool's order (if any) counting the
        requests sent ahead."""
        by_row = self._by_row
        if by_row is not None and by_row[0].valid:
            row = by_row[0].row_of(iid)
            if row >= 0:
                by_row[1][row] += requests
                by_row[2][row] += tokens
        board = self._ordered
        if board is None or not board.valid or board.order is None \
                or board.order.owner is not self:
            return
        row = board.row_of(iid)
        if row >= 0:
            board.order.ahead(row, requests, tokens)

    def _order(self, board: Board) -> DecodeOrder:
        order = super()._order(board)
        if order.owner is not self:  # a new order (or another's): what is ahead so far
            order.owner = self
            order.ahead_n[:] = 0
            order.ahead_tokens[:] = 0
            for iid, n in self._count.items():
                row = board.row_of(iid)
                if row >= 0:
                    order.ahead(row, n, self._tokens[iid])
            self._ordered = board
        return order

    def _ahead(self, board: Board) -> tuple[npt.NDArray[np.int64] | None,
                                            npt.NDArray[np.int64] | None]:
        if not self._count:
            return None, None
        by_row = self._by_row
        if by_row is None or by_row[0] is not board or not board.valid:
            m = len(board.iids)  # another pool list: count anew
            by_row = board, np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
            for iid, n in self._count.items():  # the instances with requests ahead only
                row = board.row_of(iid)
                if row >= 0:
                    by_row[1][row] = n
                    by_row[2][row] = self._tokens[iid]
            self._by_row = by_row
        return by_row[1], by_row[2]


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
                              TBTLookaheadDecode, AIBrixDecode)
}


def create_decode_selector(
    name: str, cost: CostModel, tbt_slo_s: float, rng: random.Random,
    candidates: CandidatesConfig | None = None,
) -> DecodeSelector:
    try:
        cls = DECODE_SELECTORS[name]
    except KeyError:
        raise KeyError(
            f"unknown decode selector {name!r}; known: {', '.join(sorted(DECODE_SELECTORS))}"
        ) from None
    if issubclass(cls, TBTSLODecode):
        return cls(cost, tbt_slo_s, rng, candidates)
    return cls(cost, tbt_slo_s, rng)
