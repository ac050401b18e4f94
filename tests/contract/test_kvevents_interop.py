"""KV events from every engine version we know of decode to the same batches.

``golden/kv-events-interop.json`` holds one payload per wire form vLLM and SGLang have
sent (docs/kv-events.md has the table and the sources). Each payload is the plain
msgpack encoding of the structure written beside it, built without our codec, so a
codec change cannot move the vectors along with it. The subscriber reads both replay
framings, our own publisher's batches round-trip, and a malformed payload only ever
raises :class:`DecodeError`.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from mooncake_contract.kvevents.codec import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEvent,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    hash_to_int,
    to_plain,
)
from mooncake_contract.kvevents.subscriber import KVEventSubscriber
from mooncake_worker.kvevents.publisher import KVEventPublisher

GOLDEN = json.loads((Path(__file__).parent / "golden" / "kv-events-interop.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
PAYLOADS = {name: bytes.fromhex(c["payload_hex"]) for name, c in CASES.items()}


def from_json(v: Any) -> Any:
    """The golden file's JSON form back to msgpack-level Python values."""
    if isinstance(v, dict) and set(v) == {"bin"}:
        return bytes.fromhex(v["bin"])
    if isinstance(v, list):
        return [from_json(x) for x in v]
    if isinstance(v, dict):
        return {k: from_json(x) for k, x in v.items()}
    return v


def test_every_engine_form_is_covered() -> None:
    forms = {c["engine"] for c in CASES.values()}
    assert {"vLLM", "SGLang"} <= forms
    for case in CASES.values():
        assert case["versions"] and case["sources"], case["name"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_payload_is_the_plain_msgpack_of_its_structure(name: str) -> None:
    assert msgpack.packb(from_json(CASES[name]["wire"]), use_bin_type=True) == PAYLOADS[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_decodes(name: str) -> None:
    batch = decode_batch(PAYLOADS[name])
    assert to_plain(batch) == from_json(CASES[name]["decoded"])
    assert list(batch.skipped) == CASES[name]["skipped"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_hashes_fold_to_u64(name: str) -> None:
    for ev in decode_batch(PAYLOADS[name]).events:
        if isinstance(ev, BlockStored | BlockRemoved):
            for h in ev.block_hashes:
                assert 0 <= hash_to_int(h) < 1 << 64


def test_forms_agree_on_meaning() -> None:
    """A signed hash and its unsigned twin, bytes and their low 64 bits name one block."""
    signed = decode_batch(PAYLOADS["sglang_positional_no_rank"]).events[0]
    assert isinstance(signed, BlockStored)
    negative = signed.block_hashes[0]
    assert isinstance(negative, int) and negative < 0
    assert hash_to_int(negative) == negative + (1 << 64)
    digest = decode_batch(PAYLOADS["vllm_positional_full_bytes_hashes"]).events[0]
    assert isinstance(digest, BlockStored) and isinstance(digest.block_hashes[0], bytes)
    assert hash_to_int(digest.block_hashes[0]) == int.from_bytes(digest.block_hashes[0][-8:])
    # the medium an engine did not send is the GPU; one it sent as nil stays unknown
    old = decode_batch(PAYLOADS["vllm_positional_no_rank"]).events[0]
    assert isinstance(old, BlockStored) and old.medium == "GPU"
    nil = decode_batch(PAYLOADS["sglang_positional_medium"]).events[1]
    assert isinstance(nil, BlockStored) and nil.medium is None


def test_sglang_metadata_is_not_taken_for_lora_name() -> None:
    salted, plain = decode_batch(PAYLOADS["sglang_positional_cache_salt"]).events
    assert isinstance(salted, BlockStored) and isinstance(plain, BlockStored)
    assert (salted.cache_salt, salted.lora_name) == ("tenant-a", None)
    assert plain.cache_salt is None
    meta = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2, "metadata": {"cache_salt": "t", "x": 1}}
    ev = decode_batch(msgpack.packb([1.0, [meta], None])).events[0]
    assert isinstance(ev, BlockStored) and ev.cache_salt == "t"


def test_our_encoding_is_read_back_from_every_form() -> None:
    """Decoded batches re-encode in our (vLLM map) form and decode to the same batch."""
    for name, payload in PAYLOADS.items():
        batch = decode_batch(payload)
        again = decode_batch(encode_batch(batch))
        assert again.events == batch.events, name
        assert again.data_parallel_rank == batch.data_parallel_rank


# -- malformed payloads ---------------------------------------------------------------------

STORED = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU"}


def stored(**change: Any) -> dict[str, Any]:
    return {**STORED, **change}


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in STORED.items() if k != key}


def batch(*events: Any, ts: Any = 1.0, rank: Any = None) -> bytes:
    payload: bytes = msgpack.packb([ts, list(events), rank], use_bin_type=True)
    return payload


MALFORMED: dict[str, bytes] = {
    "empty": b"",
    "never-used byte": b"\xc1",
    "trailing bytes": batch() + b"\x00",
    "not a batch (int)": msgpack.packb(7),
    "not a batch (str)": msgpack.packb("batch"),
    "batch array too short": msgpack.packb([1.0]),
    "batch map without events": msgpack.packb({"ts": 1.0}),
    "batch map without ts": msgpack.packb({"events": []}),
    "ts a string": batch(ts="now"),
    "ts a bool": batch(ts=True),
    "ts nil": batch(ts=None),
    "events a map": msgpack.packb([1.0, {"type": "AllBlocksCleared"}, None]),
    "events nil": msgpack.packb([1.0, None, None]),
    "rank a string": batch(rank="0"),
    "rank a float": batch(rank=0.5),
    "rank a bool": batch(rank=False),
    "event an int": batch(42),
    "event nil": batch(None),
    "event a string": batch("BlockStored"),
    "event map without type": batch({"block_hashes": [1]}),
    "event type an int": batch({"type": 3}),
    "event type nil": batch({"type": None}),
    "empty positional event": batch([]),
    "positional tag an int": batch([1, [1]]),
    "BlockStored without fields": batch({"type": "BlockStored"}),
    "BlockStored without block_hashes": batch(without("block_hashes")),
    "BlockStored without parent": batch(without("parent_block_hash")),
    "BlockStored without token_ids": batch(without("token_ids")),
    "BlockStored without block_size": batch(without("block_size")),
    "block_hashes a map": batch(stored(block_hashes={"a": 1})),
    "block_hashes an int": batch(stored(block_hashes=1)),
    "a hash a string": batch(stored(block_hashes=["ab"])),
    "a hash a float": batch(stored(block_hashes=[1.5])),
    "a hash nil": batch(stored(block_hashes=[None])),
    "a hash a bool": batch(stored(block_hashes=[True])),
    "a hash an array": batch(stored(block_hashes=[[1]])),
    "parent a string": batch(stored(parent_block_hash="p")),
    "token_ids a string": batch(stored(token_ids="abc")),
    "a token a float": batch(stored(token_ids=[1, 2.0])),
    "a token nil": batch(stored(token_ids=[1, None])),
    "block_size a string": batch(stored(block_size="16")),
    "block_size nil": batch(stored(block_size=None)),
    "block_size a bool": batch(stored(block_size=True)),
    "lora_id a string": batch(stored(lora_id="a")),
    "medium an int": batch(stored(medium=1)),
    "lora_name an int": batch(stored(lora_name=5)),
    "extra_keys a string": batch(stored(extra_keys="k")),
    "group_idx a string": batch(stored(group_idx="0")),
    "kv_cache_spec_kind an int": batch(stored(kv_cache_spec_kind=1)),
    "sliding window a string": batch(stored(kv_cache_spec_sliding_window="w")),
    "locality an int": batch(stored(locality=1)),
    "session_id an int": batch(stored(session_id=1)),
    "lookahead tokens strings": batch(stored(lookahead_token_ids=[["a"]])),
    "lookahead tokens flat": batch(stored(lookahead_token_ids=[1, 2])),
    "cache_salt an int": batch(stored(cache_salt=1)),
    "metadata a string": batch(stored(metadata="salt")),
    "metadata cache_salt an int": batch(stored(metadata={"cache_salt": 1})),
    "BlockRemoved without hashes": batch({"type": "BlockRemoved", "medium": "GPU"}),
    "BlockRemoved hashes nil": batch({"type": "BlockRemoved", "block_hashes": None}),
    "BlockRemoved medium an int": batch({"type": "BlockRemoved", "block_hashes": [1],
                                         "medium": 0}),
    "positional BlockStored too short": batch(["BlockStored", [1], None, [1, 2]]),
    "positional BlockStored block_size a string": batch(["BlockStored", [1], None, [1], "x"]),
    "positional BlockStored hashes nil": batch(["BlockStored", None, None, [1], 1]),
    "positional lora_name an int": batch(["BlockStored", [1], None, [1], 1, None, "GPU", 5]),
    "positional metadata salt an int": batch(
        ["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": 2}]),
    "positional BlockRemoved too short": batch(["BlockRemoved"]),
    "positional BlockRemoved medium an int": batch(["BlockRemoved", [1], 7]),
    "unhashable map key": b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81\x91\x01\x01\xc0",
    "invalid utf-8 in a string": b"\x93\xcb" + b"\x00" * 8 + b"\x91\x91\xa2\xff\xfe\xc0",
    "ext type as a hash": batch(stored(block_hashes=[msgpack.ExtType(5, b"x")])),
    "timestamp ext as ts": msgpack.packb([msgpack.Timestamp(1, 0), [], None], datetime=False),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_payload_is_a_decode_error(name: str) -> None:
    with pytest.raises(DecodeError):
        decode_batch(MALFORMED[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_truncation_is_a_decode_error(name: str) -> None:
    payload = PAYLOADS[name]
    for n in range(len(payload)):
        with pytest.raises(DecodeError):
            decode_batch(payload[:n])


def test_mutated_payloads_decode_or_raise_decode_error() -> None:
    """Random byte flips, insertions and deletions: a batch or a DecodeError, nothing else."""
    rng = random.Random(1337)
    edits: list[Callable[[bytearray], None]] = [
        lambda b: b.__setitem__(rng.randrange(len(b)), rng.randrange(256)),
        lambda b: b.insert(rng.randrange(len(b)), rng.randrange(256)),
        lambda b: b.__delitem__(rng.randrange(len(b))),
    ]
    outcomes = {"decoded": 0, "rejected": 0}
    for payload in PAYLOADS.values():
        for _ in range(150):
            data = bytearray(payload)
            for _ in range(rng.randint(1, 3)):
                rng.choice(edits)(data)
            try:
                assert isinstance(decode_batch(bytes(data)), KVEventBatch)
                outcomes["decoded"] += 1
            except DecodeError:
                outcomes["rejected"] += 1
    assert outcomes["decoded"] > 0 and outcomes["rejected"] > 0


# -- our publisher, the subscriber and the ZeroMQ framings ---------------------------------

EVENTS: list[KVEvent] = [
    BlockStored([1 << 63, 7], None, list(range(32)), 16, None, "GPU", None, group_idx=0),
    BlockStored([b"\x01" * 32], 7, list(range(16)), 16, 2, "CPU", "adapter",
                extra_keys=[["salt"]], kv_cache_spec_kind="full_attention"),
    BlockRemoved([7], "GPU"),
    AllBlocksCleared(),
]


def test_worker_publisher_batches_round_trip() -> None:
    async def main() -> list[list[bytes]]:
        pub = KVEventPublisher("tcp://127.0.0.1:*", topic=b"kv@pod@model",
                               data_parallel_rank=3)
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        try:
            frames: list[list[bytes]] = []
            for _ in range(50):  # ZeroMQ slow joiner: publish until one arrives
                pub.publish(EVENTS, ts=12.5)
                try:
                    frames.append(await asyncio.wait_for(sub.recv_multipart(), 0.1))
                    break
                except TimeoutError:
                    continue
            return frames
        finally:
            sub.close(0)
            ctx.term()
            await pub.close()

    frames = asyncio.run(main())
    assert frames, "no message from the publisher"
    topic, seq, payload = frames[0]
    assert topic == b"kv@pod@model" and len(seq) == 8 and decode_seq(seq) >= 0
    batch = decode_batch(payload)
    assert batch == KVEventBatch(12.5, EVENTS, 3)
    assert encode_batch(batch) == payload


def _payload(i: int) -> bytes:
    return encode_batch(KVEventBatch(float(i), [BlockStored([100 + i], None, [i] * 16, 16)]))


async def _fake_replay_router(with_topic: bool, buffered: range) -> tuple[str, asyncio.Task[None]]:
    """A ROUTER answering one replay request the way vLLM < 0.26 / SGLang do
    (``[b"", seq, payload]``) or vLLM >= 0.26 does (``[b"", topic, seq, payload]``)."""
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    topic = [b"kv-events"] if with_topic else []

    async def serve() -> None:
        try:
            ident, _empty, start = await router.recv_multipart()
            for seq in buffered:
                if seq >= decode_seq(start):
                    await router.send_multipart(
                        [ident, b"", *topic, seq.to_bytes(8, "big"), _payload(seq)])
            end = [b""] if with_topic else []
            await router.send_multipart([ident, b"", *end, encode_seq(END_SEQ), b""])
        finally:
            router.close(0)

    return endpoint, asyncio.get_running_loop().create_task(serve())


@pytest.mark.parametrize("with_topic", [False, True], ids=["no-topic-frame", "topic-frame"])
def test_subscriber_replays_both_framings(with_topic: bool) -> None:
    async def main() -> tuple[list[int], KVEventSubscriber]:
        endpoint, server = await _fake_replay_router(with_topic, range(6))
        got: list[int] = []
        sub = KVEventSubscriber("tcp://127.0.0.1:1", lambda s, _b: got.append(s),
                                replay_endpoint=endpoint, expected_seq=0,
                                replay_timeout_s=5.0)
        await sub.handle([b"", encode_seq(0), _payload(0)])
        await sub.handle([b"", encode_seq(4), _payload(4)])  # 1..3 lost on the wire
        await asyncio.wait_for(server, 5)
        return got, sub

    got, sub = asyncio.run(main())
    assert got == [0, 1, 2, 3, 4]
    assert (sub.gaps, sub.replayed, sub.lost) == (1, 3, 0)


def test_subscriber_counts_skipped_event_types() -> None:
    payload = PAYLOADS["forward_compatible_unknowns"]

    async def main() -> tuple[list[KVEventBatch], KVEventSubscriber]:
        got: list[KVEventBatch] = []
        sub = KVEventSubscriber("tcp://127.0.0.1:1", lambda _s, b: got.append(b))
        await sub.handle([b"", encode_seq(0), payload])
        await sub.handle([b"", encode_seq(1), payload])
        return got, sub

    got, sub = asyncio.run(main())
    assert [len(b.events) for b in got] == [3, 3]
    assert sub.unknown_events == 4 and sub.bad == 0
