"""``sglang-cache-aware+``: SGLang's ``cache_aware`` rule with two choices made by load.

Rule: exactly ``sglang-cache-aware`` (router-side approximate trees, the imbalance guard,
``cache_threshold`` 0.3), except that a request whose best match is below the threshold
goes to the least loaded worker instead of the one with the smallest tree, and workers
tied on the best match are told apart by load instead of by who was stored first. Not
SGLang's code path: a stronger reading we keep beside the upstream one, so a margin over
``sglang-cache-aware`` cannot come from those two choices alone.
"""

from __future__ import annotations

from .base import register
from .sglang_cache_aware import SGLangBase


@register
class SGLangCacheAwarePlusPolicy(SGLangBase):
    name = "sglang-cache-aware+"
    by_load = True
