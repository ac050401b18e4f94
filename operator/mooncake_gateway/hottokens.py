"""Token ids of hot prefixes, for the agents that warm them on real engines.

The Conductor's hot-prefix tracker knows prefixes by their block keys; an agent in front
of vLLM can only warm a prefix by sending its tokens. Keeping every request's tokens
would cost gigabytes, so the gateway gives its Conductor a tracker that also keeps
tokens (:class:`HotPrefixTokens`, the core's :class:`HotPrefixTracker` plus this): when
``record`` has counted a decision's access (the prefix the cluster already holds for the
request, its first ``blocks`` keys), a prefix whose decayed rate has reached
``rate_share`` of the hot threshold — hot, or about to be — gets the request's tokens
copied, once, into an LRU bounded in prefixes and in tokens. The gateway hands the
request's tokens over in :attr:`HotPrefixTokens.prompt` for the length of the ``schedule``
call. Per decision that is one lookup of the entry ``record`` has just updated (warm in
the cache) and a comparison; the LRU is touched only for prefixes past the threshold.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import numpy.typing as npt
from mooncake_conductor.replication import HotPrefixTracker, ReplicationConfig

TokenArray = npt.NDArray[np.int64]
_record = HotPrefixTracker.record


class HotPrefixTokens(HotPrefixTracker):
    def __init__(self, config: ReplicationConfig, block_size: int, rate_share: float,
                 max_prefixes: int, max_tokens: int) -> None:
        super().__init__(config)
        self.block_size = block_size
        self.threshold = rate_share * config.min_rate_per_s
        self.min_blocks = config.min_blocks
        self.max_prefixes = max_prefixes
        self.max_tokens = max_tokens
        #: the tokens of the request being scheduled (set around ``schedule``)
        self.prompt: TokenArray | None = None
        self._tokens: OrderedDict[int, TokenArray] = OrderedDict()
        self.kept_tokens = 0
        self.copies = 0

    def record(self, keys: list[int] | tuple[int, ...], now: float,
               blocks: int | None = None,
               key_array: npt.NDArray[np.uint64] | None = None) -> None:
        _record(self, keys, now, blocks, key_array)  # the tracker's own (no super() lookup)
        prompt = self.prompt
        if prompt is None:
            return
        n = len(keys) if blocks is None else min(blocks, len(keys))
        if n < self.min_blocks:
            return
        prefix = keys[n - 1]
        # the entry record() has just counted (in the cache): most prefixes stop here,
        # without touching the kept tokens
        entry = self._tracked.get(prefix)
        if entry is None or entry.rate < self.threshold:
            return
        kept = self._tokens
        if prefix in kept:
            kept.move_to_end(prefix)
        else:
            self._keep(prefix, prompt[: n * self.block_size])

    def _keep(self, prefix: int, tokens: TokenArray) -> None:
        n = len(tokens)
        if n > self.max_tokens or not self.max_prefixes:
            return
        kept = self._tokens
        kept[prefix] = tokens.copy()  # the request's array is not held on to
        self.kept_tokens += n
        self.copies += 1
        while len(kept) > self.max_prefixes or self.kept_tokens > self.max_tokens:
            _, old = kept.popitem(last=False)
            self.kept_tokens -= len(old)

    def tokens(self, prefix: int) -> TokenArray | None:
        """The token ids of ``prefix`` (its last block key), when kept."""
        return self._tokens.get(prefix)

    def kept(self) -> int:
        """How many prefixes have their tokens kept."""
        return len(self._tokens)
