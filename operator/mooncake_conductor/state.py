"""What the Conductor knows about a request and about the cluster at decision time.

The simulator and the gateway both keep these objects up to date (the simulator
from its event loop, the gateway from in-flight accounting, engine metrics and
KV events); policies only read them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, overload

import numpy as np
import numpy.typing as npt

from .index import PrefixIndex

#: prefills an instance's observed average weighs equally before it moves on
#: (:meth:`PrefillState.observe_prefill`)
AVG_PREFILL_WINDOW = 50


@dataclass(slots=True)
class RequestInfo:
    """One request as the scheduler sees it."""

    rid: int
    arrival: float
    input_tokens: int
    output_tokens: int
    keys: list[int]
    block_tokens: int
    #: the same keys as a uint64 array, when the caller has one (large-index matching
    #: uses it as is)
    key_array: npt.NDArray[np.uint64] | None = None

    def tokens_of(self, blocks: int) -> int:
        """Prompt tokens covered by the first ``blocks`` blocks (the last may be partial)."""
        return min(blocks * self.block_tokens, self.input_tokens)


@dataclass(order=True, slots=True)
class QueuedWork:
    """A prefill waiting on an instance; served in ``priority`` order (FIFO = arrival)."""

    priority: float
    seq: int
    rid: int = field(compare=False)
    work_s: float = field(compare=False)
    blocks: int = field(compare=False, default=0)
    tokens: int = field(compare=False, default=0)


class Board:
    """Numpy columns of a list of instance states, one row per state in list order,
    that compiled rankings read instead of visiting every object. The states write
    through to it (see :func:`_column`), so it is always current; a state bound to
    another board invalidates this one. Get one with :func:`board_of`."""

    __slots__ = ("_live_groups", "_live_mask", "_outside", "_row_index", "columns", "iids",
                 "masked", "order", "source", "states", "valid")

    def __init__(self, states: Sequence[_Instance]) -> None:
        self.states: list[Any] = list(states)
        #: the sequence last asked about with these states (:func:`board_of`)
        self.source: Sequence[_Instance] = states
        self.valid = True
        self._live_mask: int | None = None
        self._live_groups: frozenset[int] | None = None
        #: the pool's load order (:mod:`.candidates`), made on first use; every write of
        #: a column it watches touches it
        self.order: Any = None
        #: how many :meth:`take_down` calls are in force: the order does not see them (a
        #: decision then takes the full pass)
        self.masked = 0
        #: per group, the rows of the states up in other groups (until up/group change)
        self._outside: dict[int, npt.NDArray[np.intp]] = {}
        kinds: dict[str, type] = type(states[0]).COLUMNS
        self.columns: dict[str, npt.NDArray[Any]] = {
            name: np.fromiter([getattr(st, name) for st in states], kind, len(states))
            for name, kind in kinds.items()
        }
        self.iids: list[int] = [st.iid for st in self.states]
        self.columns["iid"] = np.array(self.iids, dtype=np.int64)  # ids never change
        self._row_index: npt.NDArray[np.int64] | None = None
        for row, st in enumerate(self.states):
            if st._board is not None and st._board is not self:
                st._board.valid = False
            st._board, st._row = self, row

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.columns[name]

    @property
    def live_mask(self) -> int:
        """The ids of the states that are up, as a bit mask (kept until one changes)."""
        if self._live_mask is None:
            self._live_mask = sum(1 << iid for iid, up in
                                  zip(self.iids, self.columns["up"].tolist(), strict=True)
                                  if up)
        return self._live_mask

    @property
    def live_groups(self) -> frozenset[int]:
        """The groups of the states that are up (kept until an ``up`` or ``group``
        changes)."""
        if self._live_groups is None:
            self._live_groups = frozenset(
                self.columns["group"][self.columns["up"]].tolist())
        return self._live_groups

    def rows_outside(self, group: int) -> npt.NDArray[np.intp]:
        """Rows of the states that are up and not in ``group`` (kept until an ``up`` or
        ``group`` changes)."""
        rows = self._outside.get(group)
        if rows is None:
            rows = np.flatnonzero(self.columns["up"] & (self.columns["group"] != group))
            self._outside[group] = rows
        return rows

    def take_down(self, rows: npt.NDArray[np.intp]) -> Callable[[], None]:
        """Mark the states at ``rows`` (rows of states that are up) down; the returned
        call puts them up again and restores the cached live mask, groups and rows
        outside groups as they were. For one decision that must not see them: the slots
        and the column are written directly (one numpy write, not a property write per
        state), and the live mask is narrowed rather than recomputed. The load order
        (:mod:`.candidates`) is not told (:attr:`masked` counts the calls in force)."""
        if not len(rows):
            return _nothing
        saved = (self._live_mask, self._live_groups, self._outside)
        states = [self.states[r] for r in rows.tolist()]
        up = self.columns["up"]
        for st in states:
            st._up = False
        up[rows] = False
        self.masked += 1
        if saved[0] is not None:
            gone = sum(1 << iid for iid in self.columns["iid"][rows].tolist())  # distinct
            self._live_mask = saved[0] & ~gone
        self._live_groups = None
        self._outside = {}  # the cached rows may hold the states taken down

        def undo() -> None:
            for st in states:
                st._up = True
            up[rows] = True
            self.masked -= 1
            self._live_mask, self._live_groups, self._outside = saved

        return undo

    @property
    def row_index(self) -> npt.NDArray[np.int64]:
        """Each instance id's row (-1: not on this board), indexed by id up to the
        largest; what :meth:`row_of` answers, for compiled code."""
        if self._row_index is None:
            index = np.full(max(self.iids, default=-1) + 1, -1, dtype=np.int64)
            index[self.columns["iid"]] = np.arange(len(self.iids))
            self._row_index = index
        return self._row_index

    def row_of(self, iid: int) -> int:
        """The row of instance ``iid`` (-1: not on this board); ids are usually rows."""
        iids = self.iids
        if iid < len(iids) and iids[iid] == iid:
            return iid
        try:
            return iids.index(iid)
        except ValueError:
            return -1


def _nothing() -> None:
    """The undo of taking nothing down."""


def board_of(states: Sequence[_Instance]) -> Board:
    """The board of ``states`` (a non-empty list of one kind), made on first use and
    again whenever the list or a state's binding changed.

    The list last asked about, at the same length, is taken as unchanged without
    comparing its elements (a pass over thousands of them on every decision): lists of
    states change in place only by appending (the gateway's membership); one whose
    element is replaced must be a new list."""
    board = states[0]._board
    if board is None or not board.valid:
        return Board(states)
    if board.source is states and len(states) == len(board.states):
        return board
    if board.states != states:  # identity, element-wise
        return Board(states)
    board.source = states
    return board


if TYPE_CHECKING:
    _T = TypeVar("_T")

    class _Column(Generic[_T]):
        """How type checkers see a :func:`_column` field: an attribute of type ``_T``."""

        @overload
        def __get__(self, obj: None, owner: Any) -> _Column[_T]: ...
        @overload
        def __get__(self, obj: object, owner: Any) -> _T: ...
        def __get__(self, obj: object, owner: Any) -> _T | _Column[_T]: ...
        def __set__(self, obj: object, value: _T) -> None: ...


#: columns whose writes change a board's live mask or live groups
_LIVE_COLUMNS = frozenset({"up", "group"})


def _column(name: str) -> Any:
    """A field read from the object (C speed) and written to it and to its board."""
    slot = "_" + name
    live = name in _LIVE_COLUMNS

    def write(self: _Instance, value: Any) -> None:
        setattr(self, slot, value)
        board = self._board
        if board is not None:
            board.columns[name][self._row] = value
            order = board.order
            if order is not None and name in order.WATCHED:
                order.touch(self._row)
            if live:
                board._live_mask = None
                board._live_groups = None
                board._outside.clear()

    return property(attrgetter(slot), write)


def _group_column() -> Any:
    """The ``group`` column, also counting the states whose group is not 0
    (:attr:`_Instance.nonzero_groups`): while there are none, no cluster can span two
    groups, which :meth:`ClusterState.grouped` answers without looking at a board."""
    column = _column("group")
    write = column.fset

    def write_group(self: _Instance, value: int) -> None:
        old = getattr(self, "_group", 0)  # unset on the first write
        if bool(old) != bool(value):
            _Instance.nonzero_groups += 1 if value else -1
        write(self, value)

    return property(column.fget, write_group)


class _Instance:
    """What prefill and decode instances share: id, name, whether they are up, their
    group, their place in the fleet's topology, and their binding to a :class:`Board`.

    ``group`` (default 0) pairs prefill with decode: while the instances that are up
    span more than one group, a request's decode instance is of its prefill
    instance's group (:meth:`ClusterState.grouped`; the gateway's groups are engine
    revisions, whose KV layouts may differ)."""

    COLUMNS: ClassVar[dict[str, type]] = {"up": np.bool_, "group": np.int64,
                                          "place": np.int64}
    __slots__ = ("_board", "_group", "_place", "_row", "_up", "iid", "name")
    _up: bool  # the slot behind ``up`` (Board.take_down writes it directly)
    _row: int  # the state's row on ``_board``, set with it
    up: _Column[bool] = _column("up")
    group: _Column[int] = _group_column()
    #: where the instance sits (:meth:`~mooncake_conductor.topology.Topology.place_id`;
    #: 0: unknown)
    place: _Column[int] = _column("place")
    #: states (of any cluster) whose group is not 0 now; a state that is dropped while
    #: in another group is never subtracted, which only costs the fast path
    nonzero_groups: ClassVar[int] = 0

    def __init__(self, iid: int, name: str, up: bool, group: int, place: int = 0) -> None:
        self._board: Board | None = None
        self.iid = iid
        self.name = name
        self.up = up
        self.group = group
        self.place = place


class PrefillState(_Instance):
    """A prefill instance: what it is running and what waits for it."""

    #: fields mirrored in a :class:`Board` (name -> numpy type)
    COLUMNS: ClassVar[dict[str, type]] = {
        **_Instance.COLUMNS, "busy_until": np.float64, "queued_work_s": np.float64,
        "queue_len": np.int64}
    __slots__ = (
        "_busy_until",
        "_queue_len",
        "_queued_work_s",
        "_seq",
        "avg_prefill_s",
        "cache_capacity_tokens",
        "completed",
        "foreign_requests",
        "foreign_work_s",
        "queue",
        "queued_blocks",
        "queued_tokens",
        "running_blocks",
        "running_tokens",
    )
    _busy_until: float  # the slots behind ``busy_until`` and ``queued_work_s`` (wait_time)
    _queued_work_s: float
    busy_until: _Column[float] = _column("busy_until")
    queued_work_s: _Column[float] = _column("queued_work_s")
    queue_len: _Column[int] = _column("queue_len")  # len(queue), kept by enqueue / pop

    def __init__(
        self, iid: int, name: str = "", up: bool = True, busy_until: float = 0.0,
        running_blocks: int = 0, running_tokens: int = 0,
        queue: list[QueuedWork] | None = None, queued_work_s: float = 0.0,
        queued_blocks: int = 0, queued_tokens: int = 0, cache_capacity_tokens: int = 0,
        avg_prefill_s: float = 0.0, completed: int = 0, group: int = 0, place: int = 0,
    ) -> None:
        super().__init__(iid, name, up, group, place)
        self.busy_until = busy_until
        self.running_blocks = running_blocks
        self.running_tokens = running_tokens
        self.queue: list[QueuedWork] = [] if queue is None else queue
        heapq.heapify(self.queue)
        self.queue_len = len(self.queue)
        self.queued_work_s = queued_work_s
        self.queued_blocks = queued_blocks
        self.queued_tokens = queued_tokens
        self.cache_capacity_tokens = cache_capacity_tokens
        self.avg_prefill_s = avg_prefill_s
        self.completed = completed
        #: the part of ``queued_work_s`` that other schedulers queued here (set_foreign)
        self.foreign_work_s = 0.0
        self.foreign_requests = 0
        self._seq = 0

    def __repr__(self) -> str:
        return (f"PrefillState(iid={self.iid}, name={self.name!r}, up={self.up}, "
                f"busy_until={self.busy_until}, queued={len(self.queue)}, "
                f"queued_work_s={self.queued_work_s})")

    def observe_prefill(self, elapsed_s: float) -> None:
        """A prefill here took ``elapsed_s`` (measured): ``completed`` counts it and
        ``avg_prefill_s`` (AIBrix's observed average) takes it in, as the plain mean of
        the first :data:`AVG_PREFILL_WINDOW` and a moving mean of about as many after.
        The gateway and the simulator both report through here."""
        self.completed += 1
        self.avg_prefill_s += ((elapsed_s - self.avg_prefill_s)
                               / min(self.completed, AVG_PREFILL_WINDOW))

    @property
    def outstanding(self) -> int:
        """Requests queued or running (SGLang's load)."""
        return len(self.queue) + (1 if self.running_tokens else 0)

    @property
    def active_blocks(self) -> int:
        """Blocks of prompts queued or being prefilled (Dynamo's active prefill blocks)."""
        return self.queued_blocks + self.running_blocks

    def running_remaining(self, now: float) -> float:
        return max(0.0, self.busy_until - now)

    def wait_time(self, now: float, priority: float | None = None) -> float:
        """Predicted seconds until a new prefill with ``priority`` starts here."""
        # running_remaining, inlined (a hot call), read from the slots behind the columns;
        # ``max(0.0, x)`` as a conditional (the same value: 0.0 unless x > 0.0)
        left = self._busy_until - now
        wait = left if left > 0.0 else 0.0
        if priority is None:
            return wait + self._queued_work_s
        return wait + self.foreign_work_s + sum(q.work_s for q in self.queue
                                                if q.priority <= priority)

    def set_foreign(self, work_s: float, requests: int = 1) -> None:
        """Prefill work (of ``requests`` prefills) that other schedulers (the other
        replicas of a gateway) have queued here, as they last reported it: part of
        ``queued_work_s`` (so every wait and kernel counts it), never of ``queue``; it is
        ahead of every new request, whatever its priority (the engine serves in arrival
        order). :mod:`mooncake_conductor.peerload`."""
        work_s = max(0.0, work_s)
        self.foreign_requests = max(0, requests) if work_s > 0 else 0
        self.queued_work_s = max(0.0, self.queued_work_s + work_s - self.foreign_work_s)
        self.foreign_work_s = work_s

    @property
    def own_work_s(self) -> float:
        """Queued work of this scheduler's own requests (``queued_work_s`` less foreign)."""
        return max(0.0, self.queued_work_s - self.foreign_work_s)

    def enqueue(self, rid: int, priority: float, work_s: float, blocks: int, tokens: int) -> None:
        self._seq += 1
        heapq.heappush(self.queue, QueuedWork(priority, self._seq, rid, work_s, blocks, tokens))
        self.queue_len = len(self.queue)
        self.queued_work_s += work_s
        self.queued_blocks += blocks
        self.queued_tokens += tokens

    def pop(self, rid: int | None = None) -> QueuedWork:
        """Take the first item in priority order, or the one for request ``rid``."""
        if rid is None:
            item = heapq.heappop(self.queue)
        else:
            pos = next(i for i, q in enumerate(self.queue) if q.rid == rid)
            item = self.queue[pos]
            self.queue[pos] = self.queue[-1]
            self.queue.pop()
            heapq.heapify(self.queue)
        self.queue_len = len(self.queue)
        self.queued_work_s = (max(self.foreign_work_s, self.queued_work_s - item.work_s)
                              if self.queue else self.foreign_work_s)
        self.queued_blocks -= item.blocks
        self.queued_tokens -= item.tokens
        return item


class DecodeState(_Instance):
    """A decode instance running a continuous batch.

    ``context_tokens + reserved_tokens`` is the KV its running requests hold or will
    hold, prompt plus output each (the gateway counts their prompts and outputs; the
    simulator their context so far and what is left): the KV room checks and
    :attr:`kv_usage` compare that sum with ``capacity_tokens``."""

    #: fields mirrored in a :class:`Board` (name -> numpy type)
    COLUMNS: ClassVar[dict[str, type]] = {
        **_Instance.COLUMNS, "batch": np.int64, "context_tokens": np.int64,
        "reserved_tokens": np.int64, "capacity_tokens": np.int64}
    __slots__ = (
        "_batch",
        "_capacity_tokens",
        "_context_tokens",
        "_reserved_tokens",
        "foreign",
        "tokens_per_s",
        "waiting",
    )
    batch: _Column[int] = _column("batch")
    context_tokens: _Column[int] = _column("context_tokens")
    reserved_tokens: _Column[int] = _column("reserved_tokens")
    capacity_tokens: _Column[int] = _column("capacity_tokens")

    def __init__(
        self, iid: int, name: str = "", up: bool = True, batch: int = 0,
        context_tokens: int = 0, capacity_tokens: int = 0, waiting: int = 0,
        reserved_tokens: int = 0, tokens_per_s: float = 0.0, group: int = 0,
        place: int = 0,
    ) -> None:
        super().__init__(iid, name, up, group, place)
        self.batch = batch
        self.context_tokens = context_tokens
        self.capacity_tokens = capacity_tokens
        self.waiting = waiting
        self.reserved_tokens = reserved_tokens
        #: tokens per second of one running sequence (1 / step time)
        self.tokens_per_s = tokens_per_s
        #: the part of (batch, context_tokens, reserved_tokens) other schedulers placed
        self.foreign: tuple[int, int, int] = (0, 0, 0)

    def __repr__(self) -> str:
        return (f"DecodeState(iid={self.iid}, name={self.name!r}, up={self.up}, "
                f"batch={self.batch}, context_tokens={self.context_tokens})")

    def set_foreign(self, batch: int, context_tokens: int, reserved_tokens: int) -> None:
        """Sequences and KV that other schedulers placed here, as they last reported
        them: part of ``batch``, ``context_tokens`` and ``reserved_tokens`` (so the
        decode selector and the KV-room checks count them). As
        :meth:`PrefillState.set_foreign`."""
        new = (max(0, batch), max(0, context_tokens), max(0, reserved_tokens))
        old = self.foreign
        self.batch = max(0, self.batch + new[0] - old[0])
        self.context_tokens = max(0, self.context_tokens + new[1] - old[1])
        self.reserved_tokens = max(0, self.reserved_tokens + new[2] - old[2])
        self.foreign = new

    @property
    def own(self) -> tuple[int, int, int]:
        """(batch, context_tokens, reserved_tokens) of this scheduler's own requests."""
        f = self.foreign
        return (max(0, self.batch - f[0]), max(0, self.context_tokens - f[1]),
                max(0, self.reserved_tokens - f[2]))

    @property
    def kv_usage(self) -> float:
        if self.capacity_tokens <= 0:
            return 0.0
        return min(1.0, (self.context_tokens + self.reserved_tokens) / self.capacity_tokens)


@dataclass(slots=True)
class ClusterState:
    """Prefill and decode instances plus the global prefix index over prefill caches.

    Prefill instance ``i`` is index id ``i``; the optional shared store pool is
    index id ``store_id`` (``None`` when there is no pool).
    """

    prefill: list[PrefillState]
    decode: list[DecodeState]
    index: PrefixIndex
    store_id: int | None = None

    @property
    def prefill_mask(self) -> int:
        mask = 0
        for p in self.prefill:
            if p.up:
                mask |= 1 << p.iid
        return mask

    def grouped(self) -> bool:
        """Whether the instances that are up span more than one group (prefill and
        decode both have some up): then a request's prefill and decode instances
        must share a group. While every state is in group 0 (the usual case) that is one
        class-attribute read; otherwise the pools' boards tell (their live groups are
        cached until an ``up`` or ``group`` changes)."""
        if not _Instance.nonzero_groups or not self.prefill or not self.decode:
            return False  # every state in group 0
        pg = board_of(self.prefill).live_groups
        dg = board_of(self.decode).live_groups
        return len(pg) > 1 or len(dg) > 1 or (bool(pg) and bool(dg) and pg != dg)
