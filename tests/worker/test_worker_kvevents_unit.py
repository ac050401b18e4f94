"""Publisher/subscriber in one process: a dropped message is recovered through the
replay socket, a publisher restart is detected; the relay's cache view maps foreign
engine hashes to the Conductor's block keys."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_contract.kvevents import BlockRemoved, BlockStored, KVEventBatch
from mooncake_contract.kvevents.codec import decode_seq, encode_seq
from mooncake_contract.kvevents.subscriber import KVEventSubscriber
from mooncake_worker.kvevents.publisher import KVEventPublisher
from mooncake_worker.relay import CacheView


def stored(i: int) -> BlockStored:
    return BlockStored([1000 + i], None, list(range(16)), 16)


def test_dropped_message_is_replayed() -> None:
    async def main() -> tuple[list[int], KVEventSubscriber]:
        pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        pub.start()
        got: list[int] = []
        sub = KVEventSubscriber(pub.endpoint, lambda s, _b: got.append(s),
                                replay_endpoint=pub.replay_endpoint, expected_seq=0)
        frames = []
        for i in range(6):
            seq = pub.publish([stored(i)])
            payload = pub.buffer[-1][1]
            frames.append([b"", encode_seq(seq), payload])
        # deliver 0, 1, (2 and 3 lost on the wire), 4, 5
        for f in (frames[0], frames[1], frames[4], frames[5]):
            await sub.handle(f)
        await pub.close()
        return got, sub

    got, sub = asyncio.run(main())
    assert got == [0, 1, 2, 3, 4, 5]
    assert sub.gaps == 1 and sub.replayed == 2 and sub.lost == 0


def test_gap_beyond_the_buffer_is_counted_lost() -> None:
    async def main() -> KVEventSubscriber:
        pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
        pub.start()
        sub = KVEventSubscriber(pub.endpoint, lambda s, b: None,
                                replay_endpoint=pub.replay_endpoint, expected_seq=0)
        for i in range(6):
            pub.publish([stored(i)])
        last = pub.buffer[-1]
        await sub.handle([b"", encode_seq(last[0]), last[1]])
        await pub.close()
        return sub

    sub = asyncio.run(main())
    assert sub.lost == 4 and sub.replayed == 1  # seq 4 still buffered; 0..3 gone


def test_publisher_restart_is_detected() -> None:
    resets: list[int] = []

    async def main() -> KVEventSubscriber:
        pub = KVEventPublisher("tcp://127.0.0.1:*")
        sub = KVEventSubscriber(pub.endpoint, lambda s, b: None,
                                on_reset=lambda: resets.append(1))
        for i in range(3):
            seq = pub.publish([stored(i)])
            await sub.handle([b"", encode_seq(seq), pub.buffer[-1][1]])
        pub2 = KVEventPublisher("tcp://127.0.0.1:*")
        seq = pub2.publish([stored(9)])
        await sub.handle([b"", encode_seq(seq), pub2.buffer[-1][1]])
        await pub.close()
        await pub2.close()
        return sub

    sub = asyncio.run(main())
    assert sub.restarts == 1 and resets == [1] and sub.next_seq == 1


def test_replay_over_real_sockets() -> None:
    async def main() -> list[int]:
        pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        pub.start()
        for i in range(4):
            pub.publish([stored(i)])
        sub = KVEventSubscriber(pub.endpoint, lambda s, b: None,
                                replay_endpoint=pub.replay_endpoint)
        out = await sub.replay(2)
        await pub.close()
        return [s for s, _b, _p in out]

    assert asyncio.run(main()) == [2, 3]


def test_cache_view_maps_foreign_hashes_to_block_keys() -> None:
    seed = namespace_seed("m", 16)
    view = CacheView(seed)
    tokens = list(range(500, 500 + 64))
    keys = block_keys(tokens, 16, seed)
    # an engine with its own hash function (here: arbitrary bytes digests), in two events
    digests = [bytes([i]) * 32 for i in range(1, 5)]
    view.apply(KVEventBatch(0.0, [BlockStored(digests[:2], None, tokens[:32], 16)]))
    view.apply(KVEventBatch(0.0, [BlockStored(digests[2:], digests[1], tokens[32:], 16)]))
    assert view.match(keys) == 4
    view.apply(KVEventBatch(0.0, [BlockRemoved([digests[2]])]))
    assert view.match(keys) == 2
    # a child whose parent was never seen cannot be mapped
    view.apply(KVEventBatch(0.0, [BlockStored([b"x" * 32], b"y" * 32, tokens[:16], 16)]))
    assert view.unmapped == 1


def test_end_marker_frame() -> None:
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1


def test_dropping_numbers_batches_but_neither_sends_nor_keeps_them() -> None:
    """The fault SIGUSR1 toggles (docs/monitoring.md, drills): the subscriber finds a gap
    that the replay cannot fill."""
    async def main() -> KVEventSubscriber:
        pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        pub.start()
        sub = KVEventSubscriber(pub.endpoint, lambda s, b: None,
                                replay_endpoint=pub.replay_endpoint, expected_seq=0)
        assert pub.publish([stored(0)]) == 0
        pub.dropping = True
        assert [pub.publish([stored(i)]) for i in (1, 2)] == [1, 2]
        assert [s for s, _ in pub.buffer] == [0] and pub.dropped == 2
        pub.dropping = False
        assert pub.publish([stored(3)]) == 3
        for seq, payload in list(pub.buffer):
            await sub.handle([b"", encode_seq(seq), payload])
        await pub.close()
        return sub

    sub = asyncio.run(main())
    assert sub.lost == 2 and sub.gaps == 1


def test_sigusr1_and_sigusr2_toggle_dropping_and_reordering_in_a_running_worker() -> None:
    import os
    import signal

    from mooncake_worker.server import _event_faults_on_signals

    async def main() -> list[tuple[bool, bool]]:
        pub = KVEventPublisher("tcp://127.0.0.1:*")
        _event_faults_on_signals(pub)
        seen = []
        for sig in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR2, signal.SIGUSR2):
            os.kill(os.getpid(), sig)
            await asyncio.sleep(0.05)
            seen.append((pub.dropping, pub.reordering))
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            asyncio.get_running_loop().remove_signal_handler(sig)
        await pub.close()
        return seen

    assert asyncio.run(main()) == [(True, False), (False, False), (False, True),
                                   (False, False)]


HOLD_S = 0.2  # the reordering publishers' wait, shorter than the default


def _sent_order(publish: Callable[[KVEventPublisher], Awaitable[None]]) -> tuple[
        list[int], KVEventPublisher]:
    """The sequence numbers in the order the PUB socket sent them while ``publish`` ran."""
    async def main() -> tuple[list[int], KVEventPublisher]:
        pub = KVEventPublisher("tcp://127.0.0.1:*", reorder_hold_s=HOLD_S)
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        await asyncio.sleep(0.2)  # the slow joiner: let the subscription reach the PUB
        await publish(pub)
        got = []
        with contextlib.suppress(TimeoutError):
            while True:
                frames = await asyncio.wait_for(sub.recv_multipart(), 0.5)
                got.append(decode_seq(frames[1]))
        sub.close(0)
        ctx.term()
        await pub.close()
        return got, pub

    return asyncio.run(main())


def test_reordering_sends_every_other_batch_after_the_next_and_keeps_the_buffer_true() -> None:
    async def publish(pub: KVEventPublisher) -> None:
        pub.reordering = True
        for i in range(5):
            pub.publish([stored(i)])
        pub.reordering = False  # releases the held 4th at once
        pub.publish([stored(5)])

    order, pub = _sent_order(publish)
    assert order == [1, 0, 3, 2, 4, 5]
    assert [s for s, _ in pub.buffer] == [0, 1, 2, 3, 4, 5]
    assert pub.reordered == 3


def test_a_held_batch_goes_out_when_none_overtakes_it() -> None:
    async def publish(pub: KVEventPublisher) -> None:
        pub.reordering = True
        pub.publish([stored(0)])
        await asyncio.sleep(HOLD_S / 2)
        assert pub.reordered == 1  # still held
        await asyncio.sleep(HOLD_S)  # released by the timer
        pub.publish([stored(1)])

    order, _ = _sent_order(publish)
    assert order == [0, 1]
