"""Imports every policy module so each registers itself."""

from . import (  # noqa: F401
    aibrix_conductor,
    conductor,
    dynamo_kv,
    kvcache_centric,
    least_load,
    llm_d,
    local_cache_aware,
    random_policy,
    round_robin,
    score,
    sglang_cache_aware,
)
