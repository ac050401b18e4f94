"""Pure encode/decode of KV-event batches (no I/O; reusable by the gateway).

Encoding (what our worker publishes) is byte-identical to vLLM's msgspec output in the
form ``shared/reference/kv-events.md`` calls vLLM 0.33 (``vllm/distributed/kv_events.py``):

- a batch is the msgpack array ``[ts: float64, events: [...], data_parallel_rank]``;
- each event is a msgpack map tagged with ``"type"`` (the class name) first, then the
  struct's fields in declaration order; optional fields equal to their default
  (``None``) are left out;
- like msgspec, the map header is sized for the struct's *possible* field count
  (tag included): up to 15 a fixmap, else a map16 (``0xde``) even when fewer entries
  are present. ``BlockStored`` has more than 15 fields, so it always gets a map16 header.

Decoding accepts every form vLLM and SGLang have sent (``docs/kv-events.md`` has the
table, by engine version, with the source of each fact):

- the batch as an array ``[ts, events]`` or ``[ts, events, dp_rank]`` (later elements
  ignored), or as a map ``{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}``;
- each event as a tagged map (keys we do not know are ignored) or as a positional
  array ``[tag, field, ...]`` in vLLM's declaration order (elements past the ones we
  know are ignored); SGLang's positional ``BlockStored`` may carry a metadata map
  (``cache_salt``, ``session_id``) where vLLM has ``lora_name``;
- block hashes as unsigned or signed 64-bit ints or as raw digest bytes
  (:func:`hash_to_int` folds them all to an unsigned 64-bit int);
- an event whose tag is a string we do not know (a newer engine's event type) is
  skipped and its tag listed in :attr:`KVEventBatch.skipped`, so the known events of
  the same batch still reach the index.

Anything else — not msgpack, truncated, a field of the wrong type, a known event
without its required fields — raises :class:`DecodeError` and nothing else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

BlockHash = int | bytes

#: The tier of a positional event too old to carry ``medium`` (vLLM before PR #19737 sent
#: only GPU-cache events). A map-shaped event without it means "not stated": engines leave
#: out a ``medium`` equal to its default ``None`` (SGLang 0.5.23).
PRE_MEDIUM = "GPU"
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
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: vLLM: the tokens past each block that went into its hash, one list per block
    lookahead_token_ids: list[list[int]] | None = None
    #: SGLang's cache namespace (its salted block hashes are seeded with it); vLLM sends
    #: its salt inside ``extra_keys`` instead
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the cache."""

    TAG: ClassVar[str] = "BlockRemoved"
    REQUIRED: ClassVar[int] = 2

    block_hashes: list[BlockHash]
    medium: str | None = None
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
    #: tags of events of a type this decoder does not know, left out of ``events``
    skipped: tuple[str, ...] = ()


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


_Check = Callable[[Any], bool]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_hash(v: Any) -> bool:
    return _is_int(v) or isinstance(v, bytes)


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _opt(check: _Check) -> _Check:
    return lambda v: v is None or check(v)


def _list_of(*types: type) -> _Check:
    """An array whose elements all have exactly one of ``types`` (``bool`` is not an int
    here); checked through the set of element types, which is cheap for long token lists."""
    allowed = frozenset(types)
    return lambda v: type(v) is list and set(map(type, v)) <= allowed


def _lists_of(*types: type) -> _Check:
    """An array of arrays, each as :func:`_list_of` ``types`` checks it."""
    inner = _list_of(*types)
    return lambda v: type(v) is list and all(map(inner, v))


#: the type each field must have on the wire (msgpack arrays decode as lists)
_TYPES: dict[str, _Check] = {
    "block_hashes": _list_of(int, bytes),
    "parent_block_hash": _opt(_is_hash),
    "token_ids": _list_of(int),
    "block_size": _is_int,
    "lora_id": _opt(_is_int),
    "medium": _opt(_is_str),
    "lora_name": _opt(_is_str),
    "extra_keys": _opt(_is_list),  # per block: an array of hash inputs, or nil
    "group_idx": _opt(_is_int),
    "kv_cache_spec_kind": _opt(_is_str),
    "kv_cache_spec_sliding_window": _opt(_is_int),
    "locality": _opt(_is_str),
    "ownership": _opt(_is_str),
    "session_id": _opt(_is_str),
    "lookahead_token_ids": _opt(_lists_of(int)),
    "cache_salt": _opt(_is_str),
}

#: fields a map-shaped event must carry (every engine version sends these)
_MAP_REQUIRED: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}

#: positional events: the fields after the tag, in the order vLLM declared them while it
#: still encoded events as arrays (up to kv_cache_spec_sliding_window), and how many
#: an array must have
_POSITIONAL: dict[str, tuple[tuple[str, ...], int]] = {
    "BlockStored": (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ),
        4,
    ),
    "BlockRemoved": (("block_hashes", "medium", "group_idx"), 1),
    "AllBlocksCleared": ((), 0),
}

#: SGLang's BlockStored metadata map (positional index 7, or a ``metadata`` map key)
_METADATA_FIELDS = ("cache_salt", "session_id")
_SGLANG_METADATA_AT = 6  # in the values after the tag: where vLLM has lora_name


def _checked(tag: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    for name, value in kwargs.items():
        if not _TYPES[name](value):
            raise DecodeError(f"{tag}.{name} has the wrong type: {type(value).__name__}")
    return kwargs


def _metadata(tag: str, meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise DecodeError(f"{tag} metadata must be a map, got {type(meta).__name__}")
    return {k: meta[k] for k in _METADATA_FIELDS if k in meta}


def _event_tag(obj: Any) -> str:
    if isinstance(obj, dict):
        tag = obj.get("type")
    elif isinstance(obj, list):
        tag = obj[0] if obj else None
    else:
        raise DecodeError(f"event must be a map or an array, got {type(obj).__name__}")
    if not isinstance(tag, str):
        raise DecodeError(f"event without a string type tag: {tag!r}")
    return tag


def _build(tag: str, obj: dict[Any, Any] | list[Any]) -> KVEvent:
    cls = _CLASSES[tag]
    names = _FIELDS[tag]
    kwargs: dict[str, Any]
    if isinstance(obj, dict):
        kwargs = {k: obj[k] for k in names if k in obj}
        if tag == "BlockStored" and "metadata" in obj:
            kwargs = {**_metadata(tag, obj["metadata"]), **kwargs}
        missing = [n for n in _MAP_REQUIRED[tag] if n not in kwargs]
        if missing:
            raise DecodeError(f"{tag} lacks {missing}")
    else:
        layout, least = _POSITIONAL[tag]
        values = obj[1:]
        if len(values) < least:
            raise DecodeError(f"{tag} has {len(values)} fields, needs {least}")
        meta: dict[str, Any] = {}
        if (
            tag == "BlockStored"
            and len(values) > _SGLANG_METADATA_AT
            and isinstance(values[_SGLANG_METADATA_AT], dict)
        ):
            meta = _metadata(tag, values[_SGLANG_METADATA_AT])
            values = values[:_SGLANG_METADATA_AT]
        kwargs = {**dict(zip(layout, values, strict=False)), **meta}
        if "medium" in layout and "medium" not in kwargs:
            kwargs["medium"] = PRE_MEDIUM  # sent before engines named the tier
    return cls(**_checked(tag, kwargs))


def decode_event(obj: Any) -> KVEvent:
    """One decoded msgpack event (map or positional array); an unknown type is an error
    here (:func:`decode_batch` skips it instead)."""
    tag = _event_tag(obj)
    if tag not in _CLASSES:
        raise DecodeError(f"unknown event type {tag!r}")
    return _build(tag, obj)


def _batch_parts(obj: Any) -> tuple[Any, Any, Any]:
    if isinstance(obj, list):
        if len(obj) < 2:
            raise DecodeError(f"batch array has {len(obj)} elements, needs [ts, events]")
        return obj[0], obj[1], obj[2] if len(obj) > 2 else None
    if isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise DecodeError("batch map lacks ts or events")
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
        return obj["ts"], obj["events"], rank
    raise DecodeError(f"batch must be an array or a map, got {type(obj).__name__}")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload in any of the forms in the module docstring."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise DecodeError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    ts, raw_events, rank = _batch_parts(obj)
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise DecodeError(f"batch timestamp must be a number, got {type(ts).__name__}")
    if not isinstance(raw_events, list):
        raise DecodeError(f"batch events must be an array, got {type(raw_events).__name__}")
    if rank is not None and not _is_int(rank):
        raise DecodeError(f"data_parallel_rank must be an int, got {type(rank).__name__}")
    events: list[KVEvent] = []
    skipped: list[str] = []
    for raw in raw_events:
        tag = _event_tag(raw)
        if tag in _CLASSES:
            events.append(_build(tag, raw))
        else:
            skipped.append(tag)
    return KVEventBatch(float(ts), events, rank, tuple(skipped))


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
