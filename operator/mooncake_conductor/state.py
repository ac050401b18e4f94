"""What the Conductor knows about a request and about the cluster at decision time.

The simulator and the gateway both keep these objects up to date (the simulator
from its event loop, the gateway from in-flight accounting, engine metrics and
KV events); policies only read them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .index import PrefixIndex


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


@dataclass(slots=True)
class PrefillState:
    """A prefill instance: what it is running and what waits for it."""

    iid: int
    name: str = ""
    up: bool = True
    busy_until: float = 0.0
    running_blocks: int = 0
    running_tokens: int = 0
    queue: list[QueuedWork] = field(default_factory=list)
    queued_work_s: float = 0.0
    queued_blocks: int = 0
    queued_tokens: int = 0
    cache_capacity_tokens: int = 0
    avg_prefill_s: float = 0.0
    completed: int = 0
    _seq: int = 0

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

    def paper_queue_time(self) -> float:
        """The paper's ``T_queue``: predicted prefill time of the requests queued here,
        without the remainder of the one already running (FAST'25 §4)."""
        return self.queued_work_s

    def wait_time(self, now: float, priority: float | None = None) -> float:
        """Predicted seconds until a new prefill with ``priority`` starts here."""
        wait = self.running_remaining(now)
        if priority is None:
            return wait + self.queued_work_s
        return wait + sum(q.work_s for q in self.queue if q.priority <= priority)

    def enqueue(self, rid: int, priority: float, work_s: float, blocks: int, tokens: int) -> None:
        self._seq += 1
        heapq.heappush(self.queue, QueuedWork(priority, self._seq, rid, work_s, blocks, tokens))
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
        self.queued_work_s = max(0.0, self.queued_work_s - item.work_s) if self.queue else 0.0
        self.queued_blocks -= item.blocks
        self.queued_tokens -= item.tokens
        return item


@dataclass(slots=True)
class DecodeState:
    """A decode instance running a continuous batch."""

    iid: int
    name: str = ""
    up: bool = True
    batch: int = 0
    context_tokens: int = 0
    capacity_tokens: int = 0
    waiting: int = 0
    reserved_tokens: int = 0
    tokens_per_s: float = 0.0  # tokens per second of one running sequence (1 / step time)

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
