"""Reusable KV-event subscriber: SUB socket, sequence-gap detection, replay via DEALER.

``on_batch(seq, batch)`` is called in sequence order. When a batch arrives with a
sequence number past the expected one, the missing batches are asked for on the
publisher's replay socket (``[b"", start_seq]`` → ``[b"", topic, seq, payload]...``,
end marker seq -1; engines older than vLLM 0.26 and SGLang send the replies without
the topic frame, ``[b"", seq, payload]``, and both forms are read) and delivered first;
batches the publisher no longer buffers are
counted in :attr:`KVEventSubscriber.lost`. A sequence number below the expected one
means the publisher restarted: :attr:`restarts` counts it, ``on_reset`` is called
(the engine's cache state starts over), the new stream's earlier batches are fetched
from the replay socket, and delivery continues from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from .codec import END_SEQ, DecodeError, KVEventBatch, decode_batch, decode_seq, encode_seq

log = logging.getLogger(__name__)
# log-only lines carry ``# pragma: no mutate`` (mutation testing, docs/mutation-testing.md)

BatchHandler = Callable[[int, KVEventBatch], Awaitable[None] | None]


class KVEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        on_batch: BatchHandler,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        expected_seq: int | None = None,
        replay_timeout_s: float = 2.0,
        on_reset: Callable[[], None] | None = None,
        context: zmq.asyncio.Context | None = None,
        on_payload: Callable[[int, bytes], None] | None = None,
    ) -> None:
        """``expected_seq``: the first sequence number wanted (``0`` replays everything the
        publisher still buffers when joining late; ``None`` starts wherever it joins)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.on_payload = on_payload  # raw payload bytes, in order (for relays)
        self.next_seq = expected_seq
        self.replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self.received = 0
        self.replayed = 0
        self.gaps = 0
        self.lost = 0
        self.restarts = 0
        self.bad = 0
        self.errors = 0
        self.unknown_events = 0  # events of a type the codec does not know (skipped)
        self._unknown_tags: set[str] = set()
        self._sub: zmq.asyncio.Socket | None = None
        self.connected = asyncio.Event()

    def connect(self) -> None:
        if self._sub is None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            self._sub = sub
            self.connected.set()

    async def run(self) -> None:
        """Receive until cancelled."""
        self.connect()
        assert self._sub is not None
        try:
            while True:
                frames = await self._sub.recv_multipart()
                try:
                    await self.handle(frames)
                except Exception:  # a failing callback must not stop the subscription
                    self.errors += 1
                    log.exception("KV-event handler failed")  # pragma: no mutate
        finally:
            self._sub.close(0)
            self._sub = None

    async def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.bad += 1
            return
        _topic, seq_frame, payload = frames
        try:
            seq = decode_seq(seq_frame)
            batch = decode_batch(payload)
        except (ValueError, DecodeError) as exc:
            self.bad += 1
            log.warning("bad KV-event message: %s", exc)  # pragma: no mutate
            return
        if self.next_seq is not None:
            if seq > self.next_seq:
                self.gaps += 1
                await self._recover(self.next_seq, seq)
            elif seq < self.next_seq:
                self.restarts += 1
                if self.on_reset is not None:
                    self.on_reset()
                if seq > 0:  # joined the restarted publisher late: fetch its start
                    self.next_seq = 0
                    self.gaps += 1
                    await self._recover(0, seq)
        self.received += 1
        await self._deliver(seq, batch, payload)

    def _note_skipped(self, batch: KVEventBatch) -> None:
        self.unknown_events += len(batch.skipped)
        for tag in set(batch.skipped) - self._unknown_tags:
            self._unknown_tags.add(tag)
            log.warning("skipping KV events of unknown type %r from %s",  # pragma: no mutate
                        tag, self.endpoint)  # pragma: no mutate

    async def _deliver(self, seq: int, batch: KVEventBatch, payload: bytes) -> None:
        self.next_seq = seq + 1
        if batch.skipped:
            self._note_skipped(batch)
        if self.on_payload is not None:
            self.on_payload(seq, payload)
        res = self.on_batch(seq, batch)
        if res is not None:
            await res

    async def replay(self, start: int) -> list[tuple[int, KVEventBatch, bytes]]:
        """Ask the replay socket for every buffered batch with seq ≥ ``start``."""
        if self.replay_endpoint is None:
            return []
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, KVEventBatch, bytes]] = []
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                # [b"", topic, seq, payload] (vLLM >= 0.26, our worker) or
                # [b"", seq, payload] (older vLLM, SGLang); the end marker likewise
                if len(frames) not in (3, 4) or frames[0] != b"":
                    continue
                try:
                    seq = decode_seq(frames[-2])
                except ValueError:
                    continue
                if seq == END_SEQ:
                    break
                with contextlib.suppress(DecodeError):
                    out.append((seq, decode_batch(frames[-1]), frames[-1]))
        except TimeoutError:
            log.warning("replay from %s timed out", self.replay_endpoint)  # pragma: no mutate
        finally:
            dealer.close(0)
        return out

    async def _recover(self, start: int, until: int) -> None:
        got = 0
        for seq, batch, payload in await self.replay(start):
            if start <= seq < until and seq >= (self.next_seq or 0):
                self.replayed += 1
                got += 1
                await self._deliver(seq, batch, payload)
        self.lost += (until - start) - got
