"""KV cache events in vLLM's wire format: codec, publisher (with replay) and subscriber."""

from .codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    hash_to_int,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "hash_to_int",
]
