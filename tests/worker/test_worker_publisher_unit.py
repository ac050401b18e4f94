"""The worker's KV-event publisher over real ZeroMQ sockets on 127.0.0.1: the PUB frames, the
replay buffer and the replay ROUTER's answers (vLLM's ZmqEventPublisher protocol)."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio
from mooncake_contract.kvevents.codec import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    encode_seq,
)
from mooncake_worker.kvevents.publisher import KVEventPublisher

ANY = "tcp://127.0.0.1:*"
WAIT_MS = 3000


def test_publish_sends_topic_seq_and_batch_to_subscribers() -> None:
    pub = KVEventPublisher(ANY)
    assert pub.replay_endpoint is None and pub.endpoint.startswith("tcp://127.0.0.1:")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        # a SUB socket joins asynchronously: publish until the first batch gets through
        deadline = time.monotonic() + 5
        frames: list[bytes] = []
        while not frames and time.monotonic() < deadline:
            pub.publish([BlockRemoved([1])], ts=12.5)
            if sub.poll(50):
                frames = sub.recv_multipart()
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == b"" and decode_seq(seq) < pub.seq
        batch = decode_batch(payload)
        assert batch.ts == 12.5 and batch.events == [BlockRemoved([1])]
        assert batch.data_parallel_rank is None
    finally:
        sub.close()
        ctx.term()
        asyncio.run(pub.close())


def test_batches_carry_rank_and_timestamp_and_numbers_count_up() -> None:
    pub = KVEventPublisher(ANY, topic=b"kv", data_parallel_rank=3)
    before = time.time()
    assert pub.publish([BlockStored([7], None, [1, 2], 2)]) == 0
    assert pub.publish([], ts=5.0) == 1
    assert pub.publish_payload(b"raw") == 2 and pub.seq == 3
    (s0, p0), (s1, p1), (s2, p2) = pub.buffer
    assert (s0, s1, s2) == (0, 1, 2) and p2 == b"raw"
    b0, b1 = decode_batch(p0), decode_batch(p1)
    assert before <= b0.ts <= time.time() and b1.ts == 5.0
    assert b0.data_parallel_rank == 3 and b0.events == [BlockStored([7], None, [1, 2], 2)]
    asyncio.run(pub.close())


def test_the_replay_buffer_keeps_the_last_steps() -> None:
    pub = KVEventPublisher(ANY)
    for i in range(10_001):
        pub.publish_payload(bytes([i % 256]))
    assert len(pub.buffer) == 10_000 and pub.buffer[0][0] == 1  # the default keeps 10000
    small = KVEventPublisher(ANY, buffer_steps=2)
    for _ in range(3):
        small.publish_payload(b"x")
    assert [s for s, _ in small.buffer] == [1, 2]
    asyncio.run(pub.close())
    asyncio.run(small.close())


async def ask(dealer: zmq.asyncio.Socket, frames: list[bytes]) -> list[list[bytes]]:
    """Send a replay request; every answer up to the end marker."""
    await dealer.send_multipart(frames)
    out = []
    while True:
        assert await dealer.poll(WAIT_MS), "no answer from the replay socket"
        msg = await dealer.recv_multipart()
        out.append(msg)
        if msg[2] == encode_seq(END_SEQ):
            return out


def test_replay_answers_from_the_start_seq_then_the_end_marker() -> None:
    async def main() -> list[list[list[bytes]]]:
        pub = KVEventPublisher(ANY, ANY, topic=b"t")
        assert pub.replay_endpoint is not None
        pub.start()
        task = pub._task
        pub.start()  # a second start keeps the one server
        assert task is not None and pub._task is task
        for i in range(4):
            pub.publish_payload(b"p%d" % i)
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            answers = [await ask(dealer, [b"", encode_seq(2)])]
            # a request of the wrong shape is ignored; the next one is still answered
            await dealer.send_multipart([b"only-one-frame"])
            answers.append(await ask(dealer, [b"", encode_seq(3)]))
            # an unreadable start seq replays everything
            answers.append(await ask(dealer, [b"", b"bad"]))
        finally:
            dealer.close()
            ctx.term()
            await pub.close()
        assert task.done()
        return answers

    from_2, from_3, everything = asyncio.run(main())
    end = [b"", b"", encode_seq(END_SEQ), b""]
    assert from_2 == [[b"", b"t", encode_seq(2), b"p2"], [b"", b"t", encode_seq(3), b"p3"], end]
    assert from_3 == [[b"", b"t", encode_seq(3), b"p3"], end]
    assert [m[2] for m in everything] == [*(encode_seq(i) for i in range(4)), encode_seq(END_SEQ)]


def test_start_without_a_replay_socket_serves_nothing() -> None:
    async def main() -> None:
        pub = KVEventPublisher(ANY)
        pub.start()
        assert pub._task is None
        await pub.close()

    asyncio.run(main())
