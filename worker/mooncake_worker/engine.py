"""The simulated engine: admission, chunked prefill and a continuous-batching decode loop.

One asyncio task (:meth:`Engine.run`) steps every running sequence. Like vLLM's
scheduler, a step runs the prompt chunks that fit its token budget (``chunked_prefill_tokens``,
in arrival order) and one token of every sequence already past prefill, as **one forward
pass**: its modelled duration is :func:`mooncake_conductor.stepcost.mixed_step_time` (one
fixed cost, the MFU of all the step's new tokens, what the decodes add), times
``time_scale`` (0: no sleep, only a yield to the event loop). With ``prefill_noise`` sigma
> 0 each request's prefill takes its own log-normal factor (median 1) times the model's
time (a step of several prompts: their FLOP-weighted mean factor), so that the model the
gateway predicts with is wrong per request, as a real engine's is. Steps are paced
against a deadline so that loop overhead does not add up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_conductor.cost import CostModel
from mooncake_conductor.stepcost import decode_share_time, mixed_step_time
from mooncake_contract.kvevents.codec import KVEvent
from mooncake_contract.tokenizer import advance, context_state, next_token

from .kvcache import Block, CacheFull, PrefixCache
from .settings import WorkerSettings

_ids = itertools.count()
log = logging.getLogger(__name__)

#: Largest lag (s) behind the modelled timeline that the step pacing makes up for.
CATCH_UP_S = 0.005


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``."""


class TooLarge(Exception):
    """The request can never fit in the KV cache."""


@dataclass(eq=False)
class EngineSeq:
    """One request inside the engine."""

    prompt: list[int]
    max_tokens: int
    keys: list[int]
    stream: asyncio.Queue[int | None] | None = None
    rid: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    reserved: int = 0
    computed: int = 0
    cached_tokens: int = 0
    state: int = 0
    arrival: float = field(default_factory=time.monotonic)
    #: this request's prefill takes ``noise`` times the cost model's time
    noise: float = 1.0
    #: its prompt's KV was pulled from a remote prefill (the decode half of a P/D pair)
    pulled: bool = False
    #: set when a step first computes part of its prompt (at admission if nothing is left
    #: to compute): with a step budget, admitted prompts can wait several steps for it
    computing: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finish_reason: str | None = None
    aborted: bool = False
    done: asyncio.Future[None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineObserver:
    """Hooks the engine calls (metrics, KV events); the defaults do nothing."""

    def on_step(self, running: int, waiting: int, usage: float) -> None: ...
    def on_prefix_query(self, queried: int, hit: int) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_token_gap(self, seconds: float, n: int = 1) -> None: ...
    def on_events(self, events: list[KVEvent]) -> None: ...


class Engine:
    def __init__(self, settings: WorkerSettings, observer: EngineObserver | None = None) -> None:
        self.settings = settings
        self.cost = CostModel(settings.cost)
        self.block_size = settings.block_size
        self.seed = namespace_seed(
            settings.model, settings.block_size, settings.lora_name, settings.cache_salt
        )
        self.cache = PrefixCache(settings.capacity_blocks, settings.block_size,
                                 settings.kv_events_medium)
        self.observer = observer or EngineObserver()
        self.waiting: deque[EngineSeq] = deque()
        self.running: list[EngineSeq] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deadline = 0.0
        self.steps = 0
        self.busy_model_s = 0.0
        self._noise = random.Random(settings.noise_seed)

    # -- public API -----------------------------------------------------------------------
    def keys_of(self, tokens: Sequence[int]) -> list[int]:
        return block_keys(tokens, self.block_size, self.seed)

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        return -(-(prompt_len + max_tokens) // self.block_size)

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        stream: bool = False,
        keys: list[int] | None = None,
        pulled: bool = False,
    ) -> EngineSeq:
        """Queue a request; raises :class:`QueueFull` or :class:`TooLarge`. ``pulled``: the
        prompt's KV came from a remote prefill (:meth:`step_plan` says what that changes)."""
        if self.blocks_needed(len(prompt), max_tokens) > self.cache.capacity:
            raise TooLarge(
                f"request needs {self.blocks_needed(len(prompt), max_tokens)} KV blocks; "
                f"the cache holds {self.cache.capacity}"
            )
        free_slots = max(0, self.settings.max_running - len(self.running))
        if len(self.waiting) >= self.settings.max_waiting + free_slots:
            raise QueueFull("waiting queue is full")
        seq = EngineSeq(
            prompt=prompt,
            max_tokens=max_tokens,
            keys=keys if keys is not None else self.keys_of(prompt),
            stream=asyncio.Queue() if stream else None,
            pulled=pulled,
        )
        seq.done = asyncio.get_running_loop().create_future()
        seq.state = context_state(prompt)
        self.waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, seq: EngineSeq) -> None:
        """Stop a request and free its KV blocks and batch slot now."""
        if seq.finished:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self._finish(seq, "abort")
        self.flush_events()

    def flush_events(self) -> None:
        if self.cache.events:
            self.observer.on_events(self.cache.take_events())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in [*self.running, *self.waiting]:
            self.abort(seq)

    # -- loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Step forever; a failing step fails its requests instead of stopping the loop."""
        while True:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine step failed; failing the affected requests")
                for seq in [*self.running, *self.waiting]:
                    with contextlib.suppress(Exception):
                        self._release(seq)
                    self._finish(seq, "error")
                self.running, self.waiting = [], deque()
                await asyncio.sleep(0)

    async def _loop(self) -> None:
        scale = self.settings.time_scale
        while True:
            if not self.running and not self.waiting:
                self.observer.on_step(0, 0, self.cache.usage)
                self._wake.clear()
                await self._wake.wait()
                self._deadline = time.monotonic()
            modelled = self.step_plan()
            self.steps += 1
            self.busy_model_s += modelled
            if scale > 0:
                now = time.monotonic()
                # pace against the previous step's deadline (absorbing loop overhead), but
                # never try to catch up more than CATCH_UP_S (e.g. after idling)
                base = self._deadline if self._deadline > now - CATCH_UP_S else now
                self._deadline = base + modelled * scale
                delay = self._deadline - now
                await asyncio.sleep(delay if delay > 0 else 0)
            else:
                await asyncio.sleep(0)
            self.step_emit()

    def _admit(self) -> None:
        bs = self.block_size
        cache = self.cache
        while self.waiting and len(self.running) < self.settings.max_running:
            seq = self.waiting[0]
            n = len(seq.prompt)
            m = cache.match(seq.keys)
            total = self.blocks_needed(n, seq.max_tokens)
            blocks = cache.acquire(seq.keys[:m])  # first, so reserving cannot evict them
            try:
                cache.reserve(total - m)
            except CacheFull:
                cache.release(blocks)
                if self.running:
                    break  # wait for running sequences to free blocks
                # nothing will free blocks (the rest is pinned): fail instead of hanging
                self.waiting.popleft()
                self._finish(seq, "error")
                continue
            self.waiting.popleft()
            seq.blocks = blocks
            seq.reserved = total - m
            # the last prompt token is always recomputed (its logits are needed)
            seq.cached_tokens = min(m * bs, n - 1) if n else 0
            seq.computed = seq.cached_tokens
            seq.tokens = list(seq.prompt)
            if self.settings.prefill_noise:
                seq.noise = self._noise.lognormvariate(0.0, self.settings.prefill_noise)
            self.observer.on_prefix_query(n, seq.cached_tokens)
            self.running.append(seq)
            if seq.computed >= n:
                seq.computing.set()

    def _grow_to(self, seq: EngineSeq, ntokens: int) -> None:
        """Make sure ``seq`` holds blocks for ``ntokens`` tokens; cache the full ones."""
        bs = self.block_size
        while len(seq.blocks) * bs < ntokens:
            seq.reserved -= 1
            seq.blocks.append(self.cache.take_reserved())
        full = min(ntokens, len(seq.tokens)) // bs
        keys = seq.keys
        for i in range(full):
            b = seq.blocks[i]
            if b.key is not None:
                continue
            if i >= len(keys):
                keys = seq.keys = self.keys_of(seq.tokens[: full * bs])
            parent = keys[i - 1] if i else None
            seq.blocks[i] = self.cache.commit(
                b, keys[i], parent, tuple(seq.tokens[i * bs : (i + 1) * bs])
            )

    def step_plan(self) -> float:
        """Admit, advance prefills, and return the step's modelled seconds.

        A pulled prompt (the decode half of a P/D pair) has all its KV once it is admitted:
        the prefill engine's partial last block came with the transfer, although the store
        keeps full blocks only. Its last token is recomputed for its logits as one more
        row of the decode step, as vLLM's scheduler runs it (``num_computed_tokens =
        num_tokens - 1`` after a remote KV load, scheduled with the running decodes), not
        as a prefill pass."""
        self._admit()
        budget = self.settings.chunked_prefill_tokens or 1 << 62
        cost = self.cost
        flops = noisy_flops = 0.0
        new_tokens = 0
        decoding = 0
        context = 0
        for seq in self.running:
            n = len(seq.prompt)
            if seq.pulled and 0 < n - seq.computed <= self.block_size:
                seq.computed = n
                self._grow_to(seq, n)
            if seq.computed < n:
                if budget <= 0:
                    continue
                chunk = min(n - seq.computed, budget)
                budget -= chunk
                seq.computing.set()
                work = cost.flops(seq.computed + chunk) - cost.flops(seq.computed)
                flops += work
                noisy_flops += seq.noise * work
                new_tokens += chunk
                seq.computed += chunk
                self._grow_to(seq, seq.computed)
            else:
                decoding += 1
                context += len(seq.tokens)
        if not new_tokens:
            return cost.decode_step_time(decoding, context)  # 0 with nothing decoding
        # one pass for every chunk, its time the FLOP-weighted mean of their noise factors
        # times the model's (a lone prompt: its own factor times its prefill time)
        factor = noisy_flops / flops if flops > 0 else 1.0
        return (factor * mixed_step_time(cost, 0, 0, flops, new_tokens)
                + decode_share_time(cost, decoding, context))

    def step_emit(self) -> None:
        """After the step's time passed: emit a token for every sequence that has one."""
        now = time.monotonic()
        obs = self.observer
        max_len = self.settings.max_model_len
        still: list[EngineSeq] = []
        gaps: dict[float, int] = {}  # previous token time -> sequences (one observe each)
        for seq in self.running:
            if seq.aborted:
                continue
            if seq.computed < len(seq.prompt):
                still.append(seq)
                continue
            if seq.max_tokens > 0:
                tok = next_token(seq.state)
                seq.state = advance(seq.state, tok)
                seq.tokens.append(tok)
                seq.generated.append(tok)
                if seq.first_token_at is None:
                    seq.first_token_at = now
                    obs.on_first_token(now - seq.arrival)
                else:
                    last = seq.last_token_at
                    gaps[last] = gaps.get(last, 0) + 1
                seq.last_token_at = now
                if seq.stream is not None:
                    seq.stream.put_nowait(tok)
                if len(seq.tokens) % self.block_size == 0:
                    self._grow_to(seq, len(seq.tokens))
            if len(seq.generated) >= seq.max_tokens or len(seq.tokens) >= max_len:
                self._release(seq)
                self._finish(seq, "length")
            else:
                still.append(seq)
        self.running = still
        for last, n in gaps.items():
            obs.on_token_gap(now - last, n)
        self.flush_events()
        obs.on_step(len(still), len(self.waiting), self.cache.usage)

    def _release(self, seq: EngineSeq) -> None:
        self.cache.release(seq.blocks)
        seq.blocks = []
        self.cache.unreserve(seq.reserved)
        seq.reserved = 0

    @staticmethod
    def _finish(seq: EngineSeq, reason: str) -> None:
        seq.finish_reason = reason
        if seq.stream is not None:
            seq.stream.put_nowait(None)
        if seq.done is not None and not seq.done.done():
            seq.done.set_result(None)

    # -- used by the store handoff and the pod agent --------------------------------------
    def insert_blocks(
        self, keys: Sequence[int], parent: int | None, tokens: Sequence[Sequence[int]]
    ) -> int:
        n = self.cache.insert(keys, parent, tokens)
        self.flush_events()
        return n

    def pin(self, keys: Sequence[int]) -> list[Block]:
        """Reference the cached prefix of ``keys`` so it cannot be evicted."""
        m = self.cache.match(keys)
        return self.cache.acquire(keys[:m])

    def unpin(self, blocks: Sequence[Block]) -> None:
        self.cache.release(blocks)

    def reset_prefix_cache(self) -> int:
        n = self.cache.clear()
        self.flush_events()
        return n


def on_done(seq: EngineSeq, fn: Callable[[EngineSeq], None]) -> None:
    assert seq.done is not None
    seq.done.add_done_callback(lambda _f: fn(seq))
