"""One KV-event subscription per engine, on top of the worker's reusable subscriber.

Adds to :class:`~mooncake_contract.kvevents.subscriber.KVEventSubscriber`:

- :meth:`EngineSubscriber.sync` asks the replay socket for everything the publisher still
  buffers (a gateway that starts late, or a second replica, builds the same index);
- batches delivered twice (live copies of what the sync replayed) are recognised by
  ``(seq, payload digest)`` and dropped instead of being taken for a publisher restart;
- a gap the replay could not fill calls ``on_lost``: the gateway then keeps that
  instance's entries, which age out as its cache turns over
  (:meth:`~mooncake_gateway.kvindex.IndexFeeder.gap`); a publisher restart calls
  ``on_reset``, which forgets them. ``on_lost`` is called where the loss is, before the
  replayed batches that came after it, so those are applied as the newest: what the gap
  may have made stale is what ages out first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from mooncake_contract.kvevents.codec import decode_seq
from mooncake_contract.kvevents.subscriber import BatchHandler, KVEventSubscriber

#: how many delivered batches are remembered to recognise duplicates
RECENT_BATCHES = 4096


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


class EngineSubscriber(KVEventSubscriber):
    def __init__(
        self,
        endpoint: str,
        on_batch: BatchHandler,
        replay_endpoint: str | None,
        topic: bytes,
        replay_timeout_s: float,
        on_reset: Callable[[], None],
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__(
            endpoint, on_batch, replay_endpoint=replay_endpoint, topic=topic, expected_seq=0,
            replay_timeout_s=replay_timeout_s, on_reset=on_reset, on_payload=self._remember,
        )
        self.on_lost = on_lost
        self.duplicates = 0
        self._recent: OrderedDict[int, bytes] = OrderedDict()

    def _remember(self, seq: int, payload: bytes) -> None:
        self._recent[seq] = _digest(payload)
        if len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)

    async def handle(self, frames: list[bytes]) -> None:
        if len(frames) == 3 and self.next_seq is not None:
            try:
                seq = decode_seq(frames[1])
            except ValueError:
                seq = None
            if seq is not None and seq < self.next_seq:
                if self._recent.get(seq) == _digest(frames[2]):
                    self.duplicates += 1
                    return
                self._recent.clear()
        await super().handle(frames)

    def close(self) -> None:
        """Close the SUB socket if :meth:`connect` opened it and :meth:`run` has not taken
        it over (run closes it itself when it ends)."""
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.close(0)

    async def sync(self) -> int:
        """Deliver every buffered batch from ``next_seq`` on; returns how many."""
        start = self.next_seq or 0
        got = 0
        for seq, batch, payload in await self.replay(start):
            if seq >= (self.next_seq or 0):
                self.replayed += 1
                got += 1
                await self._deliver(seq, batch, payload)
        return got

    async def _recover(self, start: int, until: int) -> None:
        """Deliver what the replay still has of ``start..until-1`` in order, with
        ``on_lost`` at each loss: before the batches after it, not after them all."""
        found = sorted(((seq, batch, payload) for seq, batch, payload
                        in await self.replay(start) if start <= seq < until),
                       key=lambda item: item[0])
        expected = start
        for seq, batch, payload in found:
            if seq < expected:
                continue  # the same batch twice
            if seq > expected:
                self.lost += seq - expected
                self.on_lost()
            self.replayed += 1
            await self._deliver(seq, batch, payload)
            expected = seq + 1
        if until > expected:
            self.lost += until - expected
            self.on_lost()
