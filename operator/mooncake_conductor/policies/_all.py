"""Imports every policy module so each registers itself."""

from . import (  # noqa: F401
    aibrix_conductor,
    aibrix_prefix_cache,
    conductor,
    dynamo_kv,
    kvcache_centric,
    least_load,
    llm_d,
    llm_d_precise,
    local_cache_aware,
    mooncake_paper,
    random_policy,
    round_robin,
    score,
    sglang_cache_aware,
    sglang_cache_aware_plus,
)
