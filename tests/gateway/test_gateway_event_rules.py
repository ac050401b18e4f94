"""The gateway's per-engine subscriber (:mod:`mooncake_gateway.events`) on hand-made
sequences: the sync's start and counts, gap recovery with ``on_lost`` at each loss,
duplicates of synced batches, and the SUB socket's life (real ZeroMQ on 127.0.0.1).

The replay answer (what the publisher still buffers) is given by the test; the replay
protocol itself runs over real sockets in ``test_gateway_index_resync.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import zmq
import zmq.asyncio
from mooncake_contract.kvevents.codec import (
    BlockRemoved,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_seq,
)
from mooncake_gateway.events import EngineSubscriber

Replayed = list[tuple[int, KVEventBatch, bytes]]


def payload(seq: int, variant: int = 0) -> bytes:
    return encode_batch(KVEventBatch(float(seq), [BlockRemoved([seq, variant])]))


def replayed(*seqs: int) -> Replayed:
    return [(s, decode_batch(payload(s)), payload(s)) for s in seqs]


class Recorder:
    """An :class:`EngineSubscriber` whose deliveries, losses and resets are logged in
    one timeline (so the order of ``lost`` against the batches shows)."""

    def __init__(self, answer: Replayed | None, endpoint: str = "tcp://127.0.0.1:1",
                 topic: bytes = b"", replay_endpoint: str | None = "tcp://127.0.0.1:2",
                 replay_timeout_s: float = 2.0, context: Any = None) -> None:
        self.log: list[Any] = []
        self.variants: list[int] = []
        self.asked: list[int] = []
        self.sub = EngineSubscriber(
            endpoint, self.on_batch, replay_endpoint, topic, replay_timeout_s,
            on_reset=lambda: self.log.append("reset"),
            on_lost=lambda: self.log.append("lost"))
        if context is not None:
            self.sub._ctx = context
        if answer is not None:
            async def replay(start: int) -> Replayed:
                self.asked.append(start)
                return list(answer)

            self.sub.replay = replay  # type: ignore[method-assign]

    def on_batch(self, seq: int, batch: KVEventBatch) -> None:
        ev = batch.events[0]
        assert isinstance(ev, BlockRemoved)
        assert ev.block_hashes[0] == seq
        self.log.append(seq)
        self.variants.append(int(ev.block_hashes[1]))

    async def frame(self, seq: int, variant: int = 0) -> None:
        await self.sub.handle([b"", encode_seq(seq), payload(seq, variant)])


def test_it_expects_sequence_zero_so_a_late_join_replays_the_start() -> None:
    r = Recorder(replayed(0, 1, 2))

    async def go() -> None:
        await r.frame(3)

    asyncio.run(go())
    assert r.asked == [0]
    assert r.log == [0, 1, 2, 3]
    assert (r.sub.gaps, r.sub.lost, r.sub.replayed) == (1, 0, 3)


def test_sync_asks_from_the_next_sequence_and_counts_what_it_delivers() -> None:
    r = Recorder(replayed(3, 4, 5, 6))

    async def go() -> int:
        for s in range(5):  # 0..4 came live; the publisher still buffers 3..6
            await r.frame(s)
        return await r.sub.sync()

    got = asyncio.run(go())
    assert r.asked == [5]  # from next_seq, not from 0
    assert got == 2
    assert r.log == [0, 1, 2, 3, 4, 5, 6]
    assert r.sub.replayed == 2
    assert r.sub.next_seq == 7


def test_sync_of_a_fresh_subscriber_delivers_everything_buffered() -> None:
    r = Recorder(replayed(0, 1, 2))
    got = asyncio.run(r.sub.sync())
    assert (got, r.asked, r.log, r.sub.replayed) == (3, [0], [0, 1, 2], 3)
    # the live copies of synced batches are duplicates, not a publisher restart
    asyncio.run(r.frame(1))
    asyncio.run(r.frame(2))
    assert r.sub.duplicates == 2
    assert r.sub.restarts == 0
    assert r.log == [0, 1, 2]


def test_a_different_batch_under_an_old_sequence_is_a_restart() -> None:
    r = Recorder(replayed())

    async def go() -> None:
        for s in range(3):
            await r.frame(s)
        await r.frame(0, variant=1)  # seq 0 again, another payload: the engine restarted

    asyncio.run(go())
    assert r.sub.duplicates == 0
    assert r.sub.restarts == 1
    assert r.log == [0, 1, 2, "reset", 0]


def test_recovery_delivers_in_order_once_with_lost_called_where_the_loss_is() -> None:
    # 1..6 missed; the replay answer is unordered, has 3 twice, lacks 2 and 5, and carries
    # 7 (which also comes live) and 8 (past the gap)
    r = Recorder(replayed(4, 3, 1, 3, 6, 7, 8))

    async def go() -> None:
        await r.frame(0)
        await r.frame(7)

    asyncio.run(go())
    assert r.log == [0, 1, "lost", 3, 4, "lost", 6, 7]
    assert r.sub.lost == 2
    assert r.sub.replayed == 4
    assert r.sub.gaps == 1


def test_losses_at_the_end_of_a_gap_and_across_gaps_add_up() -> None:
    r = Recorder(replayed(1, 11))

    async def go() -> None:
        await r.frame(0)
        await r.frame(4)   # 1..3 missed: 1 comes back, 2 and 3 are lost (at the end)
        await r.frame(13)  # 5..12 missed: only 11 comes back, 7 lost

    asyncio.run(go())
    assert r.log == [0, 1, "lost", 4, "lost", 11, "lost", 13]
    assert r.sub.lost == 2 + 6 + 1
    assert r.sub.replayed == 2


def test_close_releases_the_socket_and_is_safe_twice() -> None:
    async def go() -> None:
        ctx = zmq.asyncio.Context()
        r = Recorder(replayed(), context=ctx)
        r.sub.connect()
        sock = r.sub._sub
        assert sock is not None
        r.sub.close()
        assert sock.closed
        r.sub.close()  # nothing open: nothing to do
        r.sub.connect()  # a fresh socket after a close
        again = r.sub._sub
        assert again is not None and again is not sock and not again.closed
        r.sub.close()
        ctx.term()

    asyncio.run(go())


def test_only_its_own_topic_is_taken_and_replay_waits_as_long_as_configured() -> None:
    async def go() -> tuple[Recorder, float]:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")
        silent = ctx.socket(zmq.ROUTER)  # takes replay requests, never answers
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind("tcp://127.0.0.1:*")
        r = Recorder(None, endpoint=pub.getsockopt_string(zmq.LAST_ENDPOINT),  # type: ignore[arg-type]
                     topic=b"eng-a", replay_endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT),
                     replay_timeout_s=0.2, context=ctx)
        task = asyncio.create_task(r.sub.run())
        await r.sub.connected.wait()
        deadline = time.monotonic() + 5
        while not r.log:  # PUB drops what it sends before the SUB has joined
            assert time.monotonic() < deadline, "nothing came through"
            await pub.send_multipart([b"eng-b", encode_seq(0), payload(0, 9)])
            await pub.send_multipart([b"eng-a", encode_seq(0), payload(0)])
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        got = await r.sub.sync()  # the silent replay socket: gives up after the timeout
        waited = time.monotonic() - t0
        assert got == 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close(0)
        silent.close(0)
        ctx.term()
        return r, waited

    r, waited = asyncio.run(go())
    assert r.log and set(r.log) == {0}  # no restart either: eng-b's seq 0 never came in
    assert set(r.variants) == {0}  # eng-b's batches (variant 9) never reached the handler
    assert waited < 1.5  # 0.2 s configured; the default is 2 s


def test_live_batches_keep_the_memory_of_synced_ones() -> None:
    """A new live batch does not make the subscriber forget what the sync delivered: the
    late live copy of a synced batch is still a duplicate, not a restart."""
    r = Recorder(replayed(0, 1, 2))

    async def go() -> None:
        await r.sub.sync()
        await r.frame(3)  # new
        await r.frame(1)  # the live copy of a synced batch, arriving late

    asyncio.run(go())
    assert (r.sub.duplicates, r.sub.restarts) == (1, 0)
    assert r.log == [0, 1, 2, 3]


def test_the_duplicate_memory_keeps_the_latest_batches() -> None:
    from mooncake_gateway.events import RECENT_BATCHES

    r = Recorder(replayed())

    async def go() -> None:
        for s in range(RECENT_BATCHES + 1):
            await r.frame(s)
        await r.frame(1)  # still remembered (the latest RECENT_BATCHES)
        assert (r.sub.duplicates, r.sub.restarts) == (1, 0)
        await r.frame(0)  # forgotten: the same seq again reads as a restart
        assert r.sub.restarts == 1

    asyncio.run(go())


def test_malformed_frames_are_counted_bad_not_raised() -> None:
    r = Recorder(replayed())

    async def go() -> None:
        await r.frame(0)
        await r.sub.handle([b"", encode_seq(1)])                 # two frames
        await r.sub.handle([b"", b"\x00" * 7, payload(1)])       # a short sequence frame
        await r.frame(1)

    asyncio.run(go())
    assert r.sub.bad == 2
    assert r.log == [0, 1]
    assert (r.sub.restarts, r.sub.duplicates) == (0, 0)


def test_batches_sent_out_of_order_reach_the_index_in_order_once_each() -> None:
    """The worker's reordering fault (SIGUSR2, the chaos suite's ``kv-events-reorder``)
    on real sockets: each overtaking batch is a gap filled from the replay buffer, each
    late copy a duplicate; nothing is lost and nothing reads as a restart."""
    from mooncake_worker.kvevents.publisher import KVEventPublisher

    async def main() -> tuple[Recorder, KVEventPublisher]:
        pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        pub.start()
        r = Recorder(None, endpoint=pub.endpoint,
                     replay_endpoint=pub.replay_endpoint)
        task = asyncio.get_running_loop().create_task(r.sub.run())
        await asyncio.sleep(0.2)  # the slow joiner: let the subscription reach the PUB
        pub.reordering = True
        for s in range(6):
            pub.publish_payload(payload(s))
            await asyncio.sleep(0.01)
        pub.reordering = False
        await until_delivered(r, 6)
        await asyncio.sleep(0.1)  # room for a late copy to be misread
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pub.close()
        return r, pub

    async def until_delivered(r: Recorder, n: int) -> None:
        deadline = time.monotonic() + 5.0
        while len(r.log) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    r, pub = asyncio.run(main())
    assert pub.reordered == 3
    assert r.log == [0, 1, 2, 3, 4, 5]
    assert (r.sub.gaps, r.sub.replayed, r.sub.duplicates) == (3, 3, 3)
    assert (r.sub.lost, r.sub.restarts) == (0, 0)
