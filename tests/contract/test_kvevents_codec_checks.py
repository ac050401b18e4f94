"""The codec's field checks and error messages, case by case.

The type table of :mod:`mooncake_contract.kvevents.codec` is built once at import from
two small check builders (``_list_of``, ``_opt``); the builders are pinned here directly
as well as through :func:`decode_event`, so a fault in either shows up in a test run
that imports the codec once (mutation testing forks from such a process)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from mooncake_contract.kvevents import codec
from mooncake_contract.kvevents.codec import DecodeError, decode_batch, decode_event


def stored(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1, 2],
                            "parent_block_hash": None, "token_ids": [5, 6, 7, 8],
                            "block_size": 2}
    return {**base, **fields}


@pytest.mark.parametrize(("value", "ok"), [
    ([], True),
    ([1], True),
    ([b"\x01" * 8], True),
    ([1, b"\x02"], True),
    ([1.0], False),       # a float is no block hash
    ([True], False),      # bool is not an int on this wire
    ([1, "x"], False),
    ((1, 2), False),      # msgpack arrays decode as lists only
    ("ab", False),
    (None, False),
    (b"ab", False),
])
def test_list_of_accepts_exactly_lists_of_the_named_types(value: Any, ok: bool) -> None:
    check = codec._list_of(int, bytes)
    assert check(value) is ok


def test_list_of_one_type_refuses_the_other() -> None:
    ints = codec._list_of(int)
    assert ints([1, 2, 3]) is True
    assert ints([1, b"x"]) is False


def test_opt_lets_none_through_and_checks_the_rest() -> None:
    seen: list[Any] = []

    def check(v: Any) -> bool:
        seen.append(v)
        return bool(v == 3)

    opt = codec._opt(check)
    assert opt(None) is True
    assert seen == []  # None never reaches the inner check
    assert opt(3) is True
    assert opt(4) is False
    assert seen == [3, 4]


@pytest.mark.parametrize(("name", "value", "type_name"), [
    ("token_ids", [1, 2.5], "list"),
    ("token_ids", (1, 2), "tuple"),
    ("block_hashes", [1, None], "list"),
    ("block_hashes", 7, "int"),
    ("lookahead_token_ids", [1, "a"], "list"),
    ("lookahead_token_ids", [4, 5], "list"),  # one list per block, not a flat list
    ("lookahead_token_ids", [[4], ["a"]], "list"),
    ("lookahead_token_ids", [[4], None], "list"),
    ("lookahead_token_ids", 3, "int"),
])
def test_wrongly_typed_lists_are_refused_with_the_field_named(
        name: str, value: Any, type_name: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_event(stored(**{name: value}))
    assert str(err.value) == f"BlockStored.{name} has the wrong type: {type_name}"


def test_optional_lists_may_be_nil_or_well_typed() -> None:
    ev = decode_event(stored(lookahead_token_ids=None))
    assert isinstance(ev, codec.BlockStored)
    assert ev.lookahead_token_ids is None
    # vLLM 0.33: list[list[int]], the tokens past each block that went into its hash
    ev = decode_event(stored(lookahead_token_ids=[[4, 5], [], [6]]))
    assert isinstance(ev, codec.BlockStored)
    assert ev.lookahead_token_ids == [[4, 5], [], [6]]
    ev = decode_event(stored(block_hashes=[b"\x00" * 8, 9]))
    assert isinstance(ev, codec.BlockStored)
    assert ev.block_hashes == [b"\x00" * 8, 9]


@pytest.mark.parametrize(("meta", "type_name"), [([1], "list"), ("salt", "str"), (3, "int")])
def test_metadata_must_be_a_map(meta: Any, type_name: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_event(stored(metadata=meta))
    assert str(err.value) == f"BlockStored metadata must be a map, got {type_name}"


def test_metadata_keeps_only_the_namespace_fields() -> None:
    ev = decode_event(stored(metadata={"cache_salt": "s1", "session_id": "abc", "other": 1}))
    assert isinstance(ev, codec.BlockStored)
    assert (ev.cache_salt, ev.session_id) == ("s1", "abc")
    # a field of the event itself wins over the same one in its metadata
    ev = decode_event(stored(cache_salt="outer", metadata={"cache_salt": "inner"}))
    assert isinstance(ev, codec.BlockStored)
    assert ev.cache_salt == "outer"


def test_unknown_type_is_named_in_the_error() -> None:
    with pytest.raises(DecodeError) as err:
        decode_event({"type": "BlockMoved", "block_hashes": [1]})
    assert str(err.value) == "unknown event type 'BlockMoved'"
    # in a batch the same event is skipped and its tag kept
    batch = decode_batch(msgpack.packb([1.5, [{"type": "BlockMoved"}, stored()]]))
    assert batch.skipped == ("BlockMoved",)
    assert len(batch.events) == 1


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 65535, 65536, 70000])
def test_array_headers_match_msgpack_at_every_size_class(n: int) -> None:
    """The encoder writes array headers itself (no per-event Python list): each size class
    (fixarray < 16, array16 < 65536, array32) must be what msgpack itself writes."""
    reference = msgpack.packb([None] * n)
    header = codec._array_header(n)
    assert reference == header + b"\xc0" * n


@pytest.mark.parametrize(("max_entries", "entries", "want"), [
    (1, 1, b"\x81"),
    (15, 3, b"\x83"),
    (15, 15, b"\x8f"),
    (16, 3, b"\xde\x00\x03"),            # msgspec sizes the header by the struct's fields
    (17, 16, b"\xde\x00\x10"),
    (65535, 7, b"\xde\x00\x07"),
    (65536, 7, b"\xdf\x00\x00\x00\x07"),
    (70000, 65536, b"\xdf\x00\x01\x00\x00"),
])
def test_map_headers_by_the_size_class_of_the_field_count(
        max_entries: int, entries: int, want: bytes) -> None:
    assert codec._map_header(max_entries, entries) == want
    # and msgpack reads it as a map of ``entries`` entries
    body = b"".join(msgpack.packb(i) + b"\xc0" for i in range(entries))
    assert msgpack.unpackb(want + body, strict_map_key=False) == dict.fromkeys(range(entries))


@pytest.mark.parametrize("frame", [b"", b"\x00" * 7, b"\x00" * 9])
def test_a_sequence_frame_must_be_eight_bytes(frame: bytes) -> None:
    with pytest.raises(ValueError) as err:
        codec.decode_seq(frame)
    assert str(err.value) == f"sequence frame must be 8 bytes, got {len(frame)}"


def test_a_map_batch_takes_its_rank_from_sglang_attn_dp_rank_too() -> None:
    assert decode_batch(msgpack.packb({"ts": 1.0, "events": [], "attn_dp_rank": 3})) \
        .data_parallel_rank == 3
    both = {"ts": 1.0, "events": [], "data_parallel_rank": 1, "attn_dp_rank": 3}
    assert decode_batch(msgpack.packb(both)).data_parallel_rank == 1
    assert decode_batch(msgpack.packb({"ts": 1.0, "events": []})).data_parallel_rank is None


@pytest.mark.parametrize(("obj", "message"), [
    ({"ts": 1.0}, "batch map lacks ts or events"),
    ({"events": []}, "batch map lacks ts or events"),
    ([1.0], "batch array has 1 elements, needs [ts, events]"),
    ("x", "batch must be an array or a map, got str"),
    (["t", []], "batch timestamp must be a number, got str"),
    ([True, []], "batch timestamp must be a number, got bool"),
    ([1.0, {}], "batch events must be an array, got dict"),
    ([1.0, [], "r"], "data_parallel_rank must be an int, got str"),
    ([1.0, [5]], "event must be a map or an array, got int"),
    ([1.0, [[]]], "event without a string type tag: None"),
    ([1.0, [{"type": 7}]], "event without a string type tag: 7"),
    ([1.0, [{"type": "BlockRemoved"}]], "BlockRemoved lacks ['block_hashes']"),
    ([1.0, [["BlockStored", [1]]]], "BlockStored has 1 fields, needs 4"),
])
def test_malformed_batches_are_refused_with_what_is_wrong(obj: Any, message: str) -> None:
    with pytest.raises(DecodeError) as err:
        decode_batch(msgpack.packb(obj))
    assert str(err.value) == message


def test_bytes_that_are_not_msgpack_say_so() -> None:
    with pytest.raises(DecodeError) as err:
        decode_batch(b"\xc1")
    assert str(err.value).startswith("not msgpack: ")
