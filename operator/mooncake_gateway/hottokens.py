"""Token ids of hot prefixes, for the agents that warm them on real engines.

The Conductor's hot-prefix tracker knows prefixes by their block keys; an agent in front
of vLLM can only warm a prefix by sending its tokens. Keeping every request's tokens
would cost gigabytes, so :class:`HotPrefixTokens` follows the tracker's rule on the side:
each decision the tracker records (the prefix the cluster already holds for the
request: its first ``blocks`` keys) adds one unit to that prefix's exponentially
decaying access rate, with the tracker's own half-life. The tokens are copied once, by
the request that lifts the rate to ``rate_share`` of the hot threshold (a prefix about
to be hot), and kept in an LRU bounded in prefixes and in tokens. Later requests for a
kept prefix only touch its LRU entry: per request a dict lookup, and for a prefix not
kept yet, one ``exp``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from mooncake_conductor.replication import ReplicationConfig

TokenArray = npt.NDArray[np.int64]


class HotPrefixTokens:
    def __init__(self, replication: ReplicationConfig, block_size: int, rate_share: float,
                 max_prefixes: int, max_tokens: int) -> None:
        self.block_size = block_size
        self.min_blocks = replication.min_blocks
        self.max_tracked = replication.max_tracked
        self.decay = math.log(2.0) / replication.half_life_s  # as the tracker's
        self.threshold = rate_share * replication.min_rate_per_s
        self.max_prefixes = max_prefixes
        self.max_tokens = max_tokens
        self._rates: OrderedDict[int, tuple[float, float]] = OrderedDict()  # rate, at
        self._tokens: OrderedDict[int, TokenArray] = OrderedDict()
        self.kept_tokens = 0
        self.copies = 0

    def observe(self, keys: Sequence[int], blocks: int, tokens: TokenArray,
                now: float) -> None:
        """A decision the tracker records: an access to ``keys[:blocks]``, the prompt
        being ``tokens``."""
        blocks = min(blocks, len(keys))
        if blocks < self.min_blocks or not self.max_prefixes:
            return
        prefix = keys[blocks - 1]
        kept = self._tokens
        if prefix in kept:
            kept.move_to_end(prefix)
            return
        rates = self._rates
        last = rates.get(prefix)
        if last is None:
            rate = self.decay
        else:
            rate = last[0] * math.exp(-self.decay * max(0.0, now - last[1])) + self.decay
            rates.move_to_end(prefix)
        rates[prefix] = (rate, now)
        if len(rates) > self.max_tracked:
            rates.popitem(last=False)
        if rate >= self.threshold:
            self._keep(prefix, tokens[: blocks * self.block_size])

    def _keep(self, prefix: int, tokens: TokenArray) -> None:
        n = len(tokens)
        if n > self.max_tokens:
            return
        kept = self._tokens
        kept[prefix] = tokens.copy()  # the request's array is not held on to
        self._rates.pop(prefix, None)
        self.kept_tokens += n
        self.copies += 1
        while len(kept) > self.max_prefixes or self.kept_tokens > self.max_tokens:
            _, old = kept.popitem(last=False)
            self.kept_tokens -= len(old)

    def tokens(self, prefix: int) -> TokenArray | None:
        """The token ids of ``prefix`` (its last block key), when kept."""
        return self._tokens.get(prefix)

    def __len__(self) -> int:
        return len(self._tokens)
