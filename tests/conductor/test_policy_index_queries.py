"""How the policies that read the engines' prefix index query it: with the request's
uint64 key array (the large index's vectorised walk then converts nothing, per
``PrefixIndex.match_all``) and over the live prefill instances only (plus the store
pool for Algorithm 1, which fetches from it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from mooncake_conductor.index import Keys, PrefixIndex

from .helpers import cluster, policy, request

K = [1, 2, 3, 4]


class RecordingIndex(PrefixIndex):
    """A prefix index that records the mask and key array of every ``match_all``."""

    def __init__(self, capacity_blocks: int, instances: int) -> None:
        super().__init__(capacity_blocks, instances=instances)
        self.queries: list[tuple[int, object]] = []

    def match_all(
        self, keys: Keys, mask: int = -1, include_pending: bool = False,
        key_array: npt.NDArray[Any] | None = None,
    ) -> dict[int, int]:
        self.queries.append((mask, key_array))
        return super().match_all(keys, mask, include_pending, key_array)


@pytest.mark.parametrize(
    "name",
    ["aibrix-conductor", "dynamo-kv", "llm-d-precise", "local-cache-aware", "kvcache-centric"],
)
def test_engine_index_queried_with_key_array_over_live_instances(name: str) -> None:
    c = cluster(4)
    index = RecordingIndex(10_000, instances=4)
    c.index = index
    c.store_id = 4
    index.store(4, K)  # the store pool holds the prompt
    index.store(2, K)  # so does instance 2, which is down
    c.prefill[2].up = False
    req = request(K)
    req.key_array = np.asarray(K, dtype=np.uint64)
    pl = policy(name).choose(req, c, 0.0)
    assert pl.prefill in (0, 1, 3)
    live = 0b1011
    assert c.prefill_mask == live
    expected = live | 1 << 4 if name == "kvcache-centric" else live
    assert index.queries
    for mask, key_array in index.queries:
        assert mask == expected
        assert key_array is req.key_array
