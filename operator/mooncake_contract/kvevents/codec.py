"""Pure encode/decode of vLLM 0.33 KV-event batches (no I/O; reusable by the gateway).

Wire format (``vllm/distributed/kv_events.py``, msgspec):

- a batch is the msgpack array ``[ts: float64, events: [...], data_parallel_rank]``;
- each event is a msgpack map tagged with ``"type"`` (the class name) first, then the
  struct's fields in declaration order; optional fields equal to their default
  (``None``) are left out;
- like msgspec, the map header is sized for the struct's *possible* field count
  (tag included): up to 15 a fixmap, else a map16 (``0xde``) even when fewer entries
  are present. ``BlockStored`` has 15 fields, so it always gets a map16 header.

Decoding accepts both that map shape and the older positional-array shape
(``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium,
...]``), and block hashes as ints (signed or unsigned) or raw digest bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

BlockHash = int | bytes

#: Sequence number of the replay end marker.
END_SEQ = -1


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the cache (``token_ids`` are the tokens of exactly these blocks)."""

    TAG: ClassVar[str] = "BlockStored"
    REQUIRED: ClassVar[int] = 7

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the cache."""

    TAG: ClassVar[str] = "BlockRemoved"
    REQUIRED: ClassVar[int] = 2

    block_hashes: list[BlockHash]
    medium: str | None = "GPU"
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""

    TAG: ClassVar[str] = "AllBlocksCleared"
    REQUIRED: ClassVar[int] = 0


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_CLASSES: dict[str, type[BlockStored] | type[BlockRemoved] | type[AllBlocksCleared]] = {
    c.TAG: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)
}
_FIELDS: dict[str, tuple[str, ...]] = {
    tag: tuple(f.name for f in fields(cls)) for tag, cls in _CLASSES.items()
}


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def hash_to_int(h: BlockHash) -> int:
    """An engine block hash as an unsigned 64-bit int (bytes: the low 8 bytes, big-endian)."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(bytes(h[-8:]), "big")
    return int(h) & 0xFFFFFFFFFFFFFFFF


# -- encoding -------------------------------------------------------------------------------

_packer = msgpack.Packer(use_bin_type=True, use_single_float=False)


def _map_header(max_entries: int, entries: int) -> bytes:
    if max_entries < 16:
        return bytes([0x80 | entries])
    if max_entries < 1 << 16:
        return b"\xde" + struct.pack(">H", entries)
    return b"\xdf" + struct.pack(">I", entries)


def encode_event(ev: KVEvent) -> bytes:
    names = _FIELDS[ev.TAG]
    parts: list[bytes] = [_packer.pack("type"), _packer.pack(ev.TAG)]
    n = 1
    for i, name in enumerate(names):
        value = getattr(ev, name)
        if i >= ev.REQUIRED and value is None:
            continue
        parts.append(_packer.pack(name))
        parts.append(_packer.pack(value))
        n += 1
    return _map_header(len(names) + 1, n) + b"".join(parts)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Payload bytes of a batch, byte-identical to vLLM 0.33's msgspec encoding."""
    return b"".join(
        [
            b"\x93",
            b"\xcb" + struct.pack(">d", float(batch.ts)),
            _array_header(len(batch.events)),
            *(encode_event(e) for e in batch.events),
            _packer.pack(batch.data_parallel_rank),
        ]
    )


def encode_seq(seq: int) -> bytes:
    """The sequence-number frame: 8 bytes, big-endian, signed (the end marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# -- decoding -------------------------------------------------------------------------------


class DecodeError(ValueError):
    """A payload that is not a KV-event batch."""


def _event_from_map(m: dict[Any, Any]) -> KVEvent:
    tag = m.get("type")
    cls = _CLASSES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise DecodeError(f"unknown event type {tag!r}")
    names = _FIELDS[cls.TAG]
    kwargs = {k: v for k, v in m.items() if k in names}
    missing = [n for n in names[: cls.REQUIRED] if n not in kwargs and n != "medium"]
    if missing and cls is not AllBlocksCleared:
        raise DecodeError(f"{cls.TAG} lacks {missing}")
    return cls(**kwargs)


def _event_from_array(a: Sequence[Any]) -> KVEvent:
    if not a or not isinstance(a[0], str) or a[0] not in _CLASSES:
        raise DecodeError(f"unknown event {a[:1]!r}")
    cls = _CLASSES[a[0]]
    names = _FIELDS[cls.TAG]
    values = list(a[1:])
    if len(values) > len(names):
        values = values[: len(names)]
    if len(values) < min(cls.REQUIRED, 4 if cls is BlockStored else cls.REQUIRED):
        raise DecodeError(f"{cls.TAG} has too few fields")
    return cls(**dict(zip(names, values, strict=False)))


def decode_event(obj: Any) -> KVEvent:
    if isinstance(obj, dict):
        ev = _event_from_map(obj)
    elif isinstance(obj, list | tuple):
        ev = _event_from_array(obj)
    else:
        raise DecodeError(f"event must be a map or an array, got {type(obj).__name__}")
    if isinstance(ev, BlockStored | BlockRemoved) and not isinstance(ev.block_hashes, list):
        raise DecodeError("block_hashes must be an array")
    return ev


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload (map- or array-shaped events; int or bytes hashes)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise DecodeError("batch must be [ts, events, dp_rank]")
    ts = obj[0]
    if not isinstance(ts, int | float):
        raise DecodeError("batch timestamp must be a number")
    rank = obj[2] if len(obj) > 2 else None
    try:
        events = [decode_event(e) for e in obj[1]]
    except TypeError as exc:
        raise DecodeError(str(exc)) from exc
    return KVEventBatch(float(ts), events, rank if isinstance(rank, int) else None)


def to_plain(batch: KVEventBatch) -> list[Any]:
    """The batch as plain Python data (the decoded form of the golden vectors)."""
    evs: list[dict[str, Any]] = []
    for ev in batch.events:
        d: dict[str, Any] = {"type": ev.TAG}
        for i, name in enumerate(_FIELDS[ev.TAG]):
            v = getattr(ev, name)
            if i < ev.REQUIRED or v is not None:
                d[name] = v
        evs.append(d)
    return [batch.ts, evs, batch.data_parallel_rank]
