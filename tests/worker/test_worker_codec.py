"""Wire codec against vLLM 0.33's golden payloads (byte-exact) and older shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from mooncake_contract.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    KVEventBatch,
    decode_batch,
    decode_event,
    decode_seq,
    encode_batch,
    encode_seq,
    hash_to_int,
    to_plain,
)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "kv-events-golden.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_decode(name: str) -> None:
    case = CASES[name]
    batch = decode_batch(bytes.fromhex(case["payload_hex"]))
    assert to_plain(batch) == case["decoded"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_encode_is_byte_exact(name: str) -> None:
    case = CASES[name]
    ts, events, rank = case["decoded"]
    batch = KVEventBatch(ts, [decode_event(e) for e in events], rank)
    assert encode_batch(batch).hex() == case["payload_hex"]


def test_encode_builds_golden_from_dataclasses() -> None:
    batch = KVEventBatch(
        1700000001.25,
        [
            BlockStored([3333], 2222, list(range(33, 49)), 16, None, "GPU", None, group_idx=0),
            BlockRemoved([1111], "GPU"),
        ],
        0,
    )
    assert encode_batch(batch).hex() == CASES["stored_child_and_removed_dp0"]["payload_hex"]
    cleared = KVEventBatch(1700000002.0, [AllBlocksCleared()], None)
    assert encode_batch(cleared).hex() == CASES["all_cleared"]["payload_hex"]


def test_large_hashes_round_trip() -> None:
    big = (1 << 64) - 5
    batch = KVEventBatch(1.5, [BlockStored([big, 7], None, list(range(32)), 16)], None)
    back = decode_batch(encode_batch(batch))
    assert back.events[0] == batch.events[0]


def test_decodes_positional_array_events() -> None:
    payload: list[Any] = [
        12.0,
        [
            ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"],
            ["BlockRemoved", [1], "GPU"],
            ["AllBlocksCleared"],
        ],
        None,
    ]
    batch = decode_batch(msgpack.packb(payload))
    assert isinstance(batch.events[0], BlockStored)
    assert batch.events[0].block_hashes == [1, 2]
    assert batch.events[0].token_ids == list(range(32))
    assert isinstance(batch.events[1], BlockRemoved)
    assert batch.events[1].block_hashes == [1]
    assert isinstance(batch.events[2], AllBlocksCleared)


def test_bytes_and_signed_hashes() -> None:
    digest = bytes(range(32))
    payload = [1.0, [{"type": "BlockRemoved", "block_hashes": [digest, -2], "medium": "GPU"}], None]
    ev = decode_batch(msgpack.packb(payload, use_bin_type=True)).events[0]
    assert isinstance(ev, BlockRemoved)
    assert ev.block_hashes[0] == digest
    assert hash_to_int(digest) == int.from_bytes(digest[-8:], "big")
    assert hash_to_int(-2) == (1 << 64) - 2


def test_seq_frames() -> None:
    assert encode_seq(0) == b"\0" * 8
    assert encode_seq(-1) == b"\xff" * 8
    assert decode_seq(encode_seq(123456789)) == 123456789
    with pytest.raises(ValueError):
        decode_seq(b"\0")


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"not": "a batch"}),
        msgpack.packb([1.0, [{"type": 7}], None]),  # an unknown *string* tag is skipped
        msgpack.packb([1.0, [{"type": "BlockStored"}], None]),
        msgpack.packb([1.0, [42], None]),
        msgpack.packb(["ts", [], None]),
    ],
)
def test_rejects_garbage(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)
