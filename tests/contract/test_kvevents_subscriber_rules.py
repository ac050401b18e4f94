"""The subscriber's counting and recovery rules on hand-made sequences.

Recovery arithmetic is pinned with the replay answer given by the test (what the
publisher still buffers); the receive loop runs on real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from mooncake_contract.kvevents.codec import (
    END_SEQ,
    BlockRemoved,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from mooncake_contract.kvevents.subscriber import KVEventSubscriber

Replayed = list[tuple[int, KVEventBatch, bytes]]


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def payload(seq: int) -> bytes:
    """A batch whose one event names its sequence number (to see what was delivered)."""
    return encode_batch(KVEventBatch(float(seq), [BlockRemoved([seq])]))


def replayed(*seqs: int) -> Replayed:
    return [(s, decode_batch(payload(s)), payload(s)) for s in seqs]


class Recorder:
    def __init__(self, answer: Replayed, expected_seq: int | None = 0) -> None:
        self.batches: list[int] = []
        self.payloads: list[tuple[int, bytes]] = []
        self.resets = 0
        self.asked: list[int] = []
        self.sub = KVEventSubscriber(
            "tcp://127.0.0.1:1", self.on_batch, replay_endpoint="tcp://127.0.0.1:2",
            expected_seq=expected_seq, on_reset=self.on_reset,
            on_payload=lambda s, p: self.payloads.append((s, p)))

        async def replay(start: int) -> Replayed:
            self.asked.append(start)
            return [r for r in answer if r[0] >= start]

        self.sub.replay = replay  # type: ignore[method-assign]

    def on_batch(self, seq: int, batch: KVEventBatch) -> None:
        ev = batch.events[0]
        assert isinstance(ev, BlockRemoved)
        assert ev.block_hashes == [seq]  # the batch delivered is the one of that seq
        self.batches.append(seq)

    def on_reset(self) -> None:
        self.resets += 1

    async def frame(self, seq: int) -> None:
        await self.sub.handle([b"", encode_seq(seq), payload(seq)])


def test_a_gap_is_filled_from_the_replay_in_order_once_each() -> None:
    r = Recorder(replayed(0, 1, 2, 2, 3, 4, 5))  # 2 twice; 4 and 5 are past the gap

    async def go() -> None:
        await r.frame(0)
        await r.frame(4)  # 1..3 missed

    run(go())
    assert r.asked == [1]
    assert r.batches == [0, 1, 2, 3, 4]
    assert [s for s, _ in r.payloads] == [0, 1, 2, 3, 4]
    assert all(p == payload(s) for s, p in r.payloads)  # the replayed bytes, not a copy
    assert (r.sub.gaps, r.sub.replayed, r.sub.lost, r.sub.received) == (1, 3, 0, 2)
    assert r.sub.next_seq == 5


def test_lost_batches_add_up_over_gaps() -> None:
    r = Recorder(replayed(2, 6))  # the publisher kept only 2 and 6

    async def go() -> None:
        await r.frame(0)
        await r.frame(4)  # 1..3 missed, only 2 comes back: 2 lost
        await r.frame(8)  # 5..7 missed, only 6 comes back: 2 more lost

    run(go())
    assert r.batches == [0, 2, 4, 6, 8]
    assert (r.sub.gaps, r.sub.replayed, r.sub.lost) == (2, 2, 4)


def test_a_restarted_publisher_is_read_from_its_start() -> None:
    r = Recorder(replayed(0, 1, 2))

    async def go() -> None:
        await r.frame(0)
        await r.frame(1)
        await r.frame(2)
        await r.frame(3)
        await r.frame(2)  # below the expected 4: the publisher restarted, 0 and 1 missed

    run(go())
    assert r.resets == 1
    assert r.sub.restarts == 1
    assert r.sub.gaps == 1  # the restarted stream's 0 and 1 were a gap
    assert r.asked == [0]
    assert r.batches == [0, 1, 2, 3, 0, 1, 2]  # the new stream from seq 0 on
    assert (r.sub.replayed, r.sub.lost) == (2, 0)
    assert r.sub.next_seq == 3


def test_a_restart_seen_at_seq_zero_needs_no_replay() -> None:
    r = Recorder(replayed())

    async def go() -> None:
        await r.frame(0)
        await r.frame(1)
        await r.frame(0)

    run(go())
    assert (r.resets, r.asked, r.batches) == (1, [], [0, 1, 0])


def test_joining_anywhere_when_no_sequence_is_expected() -> None:
    r = Recorder(replayed(0, 1, 2), expected_seq=None)

    async def go() -> None:
        await r.frame(7)
        await r.frame(8)

    run(go())
    assert r.asked == []
    assert r.batches == [7, 8]
    assert r.sub.gaps == 0


def test_bad_frames_are_counted_not_delivered() -> None:
    r = Recorder(replayed())

    async def go() -> None:
        await r.sub.handle([b"", b"\x00", payload(0)])  # a seq frame of the wrong size
        await r.sub.handle([b"", encode_seq(0), b"\xc1"])  # not msgpack
        await r.sub.handle([b"", encode_seq(0)])  # two frames

    run(go())
    assert r.sub.bad == 3
    assert r.batches == []


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.01)


def test_a_failing_handler_is_counted_and_the_loop_goes_on_and_restarts() -> None:
    """Each batch whose handler raises adds one to ``errors``; the subscription keeps
    receiving; once cancelled, ``run`` can be started again on a fresh socket."""
    got: list[int] = []

    def on_batch(seq: int, _b: KVEventBatch) -> None:
        got.append(seq)
        if seq % 2 == 0:
            raise RuntimeError("handler bug")

    async def go() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")
        sub = KVEventSubscriber(pub.getsockopt_string(zmq.LAST_ENDPOINT), on_batch,
                                expected_seq=None, context=ctx)
        seq = 0

        async def send_until_seen(n: int) -> None:
            nonlocal seq
            deadline = time.monotonic() + 5
            while len(got) < n:  # PUB drops what it sends before the SUB is joined
                assert time.monotonic() < deadline, "no batch came through"
                await pub.send_multipart([b"", encode_seq(seq), payload(seq)])
                seq += 1
                await asyncio.sleep(0.02)

        for _round in range(2):
            got.clear()
            task = asyncio.create_task(sub.run())
            await sub.connected.wait()
            await send_until_seen(4)
            await _until(lambda: sub.received >= 4)
            errors = sum(1 for s in got if s % 2 == 0)
            assert errors >= 2
            assert sub.errors == errors
            sub.errors = 0
            sub.received = 0
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pub.close(0)
        ctx.term()

    run(go())


def _replay_with(answers: list[list[bytes]], end: bool = True,
                 timeout: float = 2.0) -> tuple[Replayed, list[int]]:
    """``replay(3)`` against a real ROUTER that answers each request with ``answers``
    (frames after the requester's identity), then the end marker unless not ``end``."""
    async def go() -> tuple[Replayed, list[int]]:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:*")
        asked: list[int] = []

        async def serve() -> None:
            ident, empty, start = await router.recv_multipart()
            assert empty == b""
            asked.append(decode_seq(start))
            for frames in answers:
                await router.send_multipart([ident, *frames])
            if end:
                await router.send_multipart([ident, b"", b"", encode_seq(END_SEQ), b""])

        server = asyncio.create_task(serve())
        sub = KVEventSubscriber("tcp://127.0.0.1:1", lambda s, b: None,
                                replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT),
                                replay_timeout_s=timeout, context=ctx)
        out = await sub.replay(3)
        await server
        router.close(0)
        ctx.term()
        return out, asked

    return asyncio.run(go())


def test_replay_reads_both_framings_and_skips_what_it_cannot_read() -> None:
    out, asked = _replay_with([
        [b"", b"topic", encode_seq(3), payload(3)],   # vLLM >= 0.26: with the topic
        [b"", encode_seq(4), payload(4)],             # older vLLM, SGLang: without
        [b"x", encode_seq(5), payload(5)],            # no empty delimiter: not a reply
        [b"", b"t", b"u", encode_seq(5), payload(5)],  # five frames: not a reply
        [b""],                                         # too short
        [b"", b"\x00", payload(5)],                   # a sequence frame of the wrong size
        [b"", encode_seq(6), b"\xc1"],                # a payload that is no msgpack
        [b"", b"topic", encode_seq(7), payload(7)],   # still read after all that
    ])
    assert asked == [3]
    assert [(s, p) for s, _b, p in out] == [(3, payload(3)), (4, payload(4)), (7, payload(7))]
    assert [s for s, b, _p in out] == [int(b.ts) for _s, b, _p in out]


def test_replay_without_an_end_marker_returns_what_came_by_the_timeout() -> None:
    t0 = time.monotonic()
    out, _ = _replay_with([[b"", encode_seq(3), payload(3)]], end=False, timeout=0.3)
    assert [s for s, _b, _p in out] == [3]
    assert time.monotonic() - t0 < 5


def test_no_replay_socket_means_nothing_to_replay() -> None:
    sub = KVEventSubscriber("tcp://127.0.0.1:1", lambda s, b: None)
    assert asyncio.run(sub.replay(0)) == []


def test_unknown_event_types_are_counted_and_warned_about_once_each(
        caplog: pytest.LogCaptureFixture) -> None:
    got: list[KVEventBatch] = []
    sub = KVEventSubscriber("tcp://127.0.0.1:1", lambda s, b: got.append(b), expected_seq=None)
    known = {"type": "BlockRemoved", "block_hashes": [1]}
    frames = [msgpack.packb([1.0, [{"type": "BlockMoved"}, known, {"type": "BlockMoved"}]]),
              msgpack.packb([2.0, [{"type": "BlockMoved"}, {"type": "Pinned"}]])]

    async def go() -> None:
        for seq, payload_ in enumerate(frames):
            await sub.handle([b"", encode_seq(seq), payload_])

    with caplog.at_level(logging.WARNING, logger="mooncake_contract.kvevents.subscriber"):
        asyncio.run(go())
    assert sub.unknown_events == 4
    assert [len(b.events) for b in got] == [1, 0]
    warned = [r.getMessage() for r in caplog.records if "unknown type" in r.getMessage()]
    assert len(warned) == 2  # BlockMoved once, Pinned once
    assert any("'BlockMoved'" in w for w in warned) and any("'Pinned'" in w for w in warned)


def test_every_restart_counts_and_a_late_join_at_seq_one_fetches_seq_zero() -> None:
    r = Recorder(replayed(0))

    async def go() -> None:
        await r.frame(0)
        await r.frame(1)
        await r.frame(2)
        await r.frame(1)  # restart, joined at 1: 0 is fetched first
        await r.frame(2)
        await r.frame(0)  # and again, from its start

    run(go())
    assert (r.resets, r.sub.restarts, r.sub.gaps) == (2, 2, 1)
    assert r.asked == [0]
    assert r.batches == [0, 1, 2, 0, 1, 2, 0]
