"""KV cache events in vLLM's wire format: the codec and the subscriber (with gap recovery).

The publisher side (with its replay buffer) is the worker's: ``mooncake_worker.kvevents``."""

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
