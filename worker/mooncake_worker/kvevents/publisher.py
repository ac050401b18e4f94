"""ZeroMQ publisher of KV-event batches with a replay buffer (vLLM's ZmqEventPublisher
protocol): PUB frames ``[topic, seq, payload]``; a ROUTER answers ``[b"", start_seq]``
with every buffered batch from ``start_seq`` on, then the end marker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio
from mooncake_contract.kvevents.codec import (
    END_SEQ,
    KVEvent,
    KVEventBatch,
    decode_seq,
    encode_batch,
    encode_seq,
)

log = logging.getLogger(__name__)

#: while reordering, how long a held batch waits for one to overtake it before it is sent
#: anyway (an idle engine publishes nothing for a while; a simulated engine under a replay
#: publishes a batch every second or two, so a shorter wait would only delay batches)
REORDER_HOLD_S = 5.0


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: bytes = b"",
        buffer_steps: int = 10000,
        data_parallel_rank: int | None = None,
        reorder_hold_s: float = REORDER_HOLD_S,
    ) -> None:
        self.topic = topic
        self.seq = 0
        #: fault injection (SIGUSR1 in ``mooncake-operator worker``): batches are numbered
        #: but neither sent nor kept for replay, as if lost beyond the replay's reach
        self.dropping = False
        self.dropped = 0
        #: fault injection (SIGUSR2): every other batch is sent after the one that follows
        #: it (or after ``reorder_hold_s``), as a network that delivers out of order;
        #: the replay buffer keeps the true order
        self.reordered = 0  # batches held back (sent after the next, or alone when none came)
        self.reorder_hold_s = reorder_hold_s
        self._reordering = False
        self._held: tuple[int, bytes] | None = None
        self._release: asyncio.TimerHandle | None = None
        self.rank = data_parallel_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._actx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._actx = zmq.asyncio.Context()
            self._router = self._actx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        batch = KVEventBatch(time.time() if ts is None else ts, list(events), self.rank)
        return self.publish_payload(encode_batch(batch))

    def publish_payload(self, payload: bytes) -> int:
        """Send an already-encoded batch unchanged (relaying another publisher)."""
        seq = self.seq
        self.seq += 1
        if self.dropping:
            self.dropped += 1
            return seq
        self.buffer.append((seq, payload))
        if self._reordering and self._held is None:
            self._held = (seq, payload)
            self.reordered += 1
            with contextlib.suppress(RuntimeError):  # no loop: the next batch releases it
                self._release = asyncio.get_running_loop().call_later(
                    self.reorder_hold_s, self._send_held)
            return seq
        self._send(seq, payload)
        self._send_held()
        return seq

    @property
    def reordering(self) -> bool:
        return self._reordering

    @reordering.setter
    def reordering(self, on: bool) -> None:
        self._reordering = on
        if not on:
            self._send_held()

    def _send_held(self) -> None:
        if self._release is not None:
            self._release.cancel()
            self._release = None
        if self._held is not None:
            held, self._held = self._held, None
            self._send(*held)

    def _send(self, seq: int, payload: bytes) -> None:
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            try:
                frames = await router.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:  # socket closed
                # logging only: mutating the message changes nothing a caller can observe
                log.debug("replay socket: %s", exc)  # pragma: no mutate
                return
            if len(frames) != 3:
                continue
            ident, _empty, start_frame = frames
            try:
                start = decode_seq(start_frame)
            except ValueError:
                start = 0
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([ident, b"", self.topic, encode_seq(seq), payload])
            await router.send_multipart([ident, b"", b"", encode_seq(END_SEQ), b""])

    async def close(self) -> None:
        if self._release is not None:
            self._release.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._router is not None:
            self._router.close(0)
        self._pub.close(0)
        self._ctx.term()
        if self._actx is not None:
            self._actx.term()
