"""The store client's bound on a stuck binding (worker/mooncake_worker/store.py), with a
fake binding in place of ``MooncakeDistributedStore``: a call that does not answer within
``store_timeout_s`` (its wait in the queue included) degrades the handoff to
recomputation (a put stores nothing, a get finds nothing) instead of holding the request;
a stuck call keeps its thread until it ends, one still queued is dropped, and while stuck
calls take every store thread the store is skipped at once.

The chaos drill that found it: a prefill engine SIGSTOPped while it held part of the
store left the other prefill engine's store calls waiting in the binding for good, and
every later request on that engine waited with them until the client's timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from mooncake_worker.store import BlockStore, encode_payload
from worker_inproc import BS, settings

TIMEOUT_S = 0.2


class FakeBinding:
    """Answers at once, or, while ``stuck``, holds every call until ``release`` is set."""

    def __init__(self, payload_bytes: int) -> None:
        self.payload_bytes = payload_bytes
        self.release = threading.Event()
        self.stuck = False
        self.objects: dict[str, bytes] = {}
        self.hold_s = 0.0  # how long each call takes when not stuck
        self.largest = 0  # the most objects one call carried
        self.running = self.most_running = 0  # calls inside the binding, now and at most
        self._count = threading.Lock()

    def _wait(self, names: list[str]) -> None:
        with self._count:
            self.largest = max(self.largest, len(names))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        if self.stuck:
            self.release.wait(30)
        time.sleep(self.hold_s)
        with self._count:
            self.running -= 1

    def batch_is_exist(self, names: list[str]) -> list[int]:
        self._wait(names)
        return [1 if n in self.objects else 0 for n in names]

    def put_batch(self, names: list[str], values: list[bytes]) -> int:
        self._wait(names)
        self.objects.update(zip(names, values, strict=True))
        return 0

    def get_batch(self, names: list[str]) -> list[bytes]:
        self._wait(names)
        return [self.objects.get(n, b"") for n in names]

    def close(self) -> None:
        pass


def client(**over: Any) -> tuple[BlockStore, FakeBinding]:
    store = BlockStore(settings(store_timeout_s=TIMEOUT_S, **over), kv_bytes_per_token=1)
    fake = FakeBinding(store.payload_bytes)
    store._store = fake
    return store, fake


def tokens_of(n: int, start: int = 0) -> list[list[int]]:
    return [list(range(start + i * BS, start + (i + 1) * BS)) for i in range(n)]


def wait_unstuck(store: BlockStore) -> None:
    deadline = time.monotonic() + 5
    while store.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stuck == 0


def test_calls_answer_through_the_store_threads() -> None:
    store, _ = client()

    async def main() -> None:
        assert await store.put_blocks([1, 2], tokens_of(2)) == 2
        got = await store.get_blocks([1, 2, 3])
        assert got == [(1, tokens_of(2)[0]), (2, tokens_of(2)[1]), None]
        assert await store.exists([2, 3]) == [True, False]
        # more calls at once than threads: queued, not skipped
        n = store.threads * 2
        puts = await asyncio.gather(*(store.put_blocks([100 + i], tokens_of(1, 100 * i))
                                      for i in range(n)))
        assert puts == [1] * n
        await store.close()

    asyncio.run(main())
    assert (store.timeouts, store.skipped, store.stuck) == (0, 0, 0)


def test_objects_in_flight_stay_within_the_bounds() -> None:
    """The binding loses transfers with many objects in flight: a large request is split
    into calls of ``store_batch_blocks``, and at most ``store_calls_in_flight`` run."""
    store, fake = client(store_batch_blocks=4, store_calls_in_flight=2)
    fake.hold_s = 0.01
    n = 10

    async def main() -> None:
        puts = await asyncio.gather(*(store.put_blocks(list(range(i * n, (i + 1) * n)),
                                                       tokens_of(n, i * n * BS))
                                      for i in range(5)))
        assert puts == [n] * 5
        got = await asyncio.gather(*(store.get_blocks(list(range(i * n, (i + 1) * n)))
                                     for i in range(5)))
        assert [sum(g is not None for g in gg) for gg in got] == [n] * 5
        assert got[1][9] == (19, tokens_of(n, n * BS)[9])  # order kept across the split
        assert await store.exists(list(range(48, 53))) == [True, True, False, False, False]
        await store.close()

    asyncio.run(main())
    assert fake.largest == 4 and fake.most_running == 2


def test_a_stuck_call_degrades_to_recomputation_within_the_timeout() -> None:
    store, fake = client()
    fake.objects[store.name(7)] = encode_payload(7, tokens_of(1)[0], store.payload_bytes)
    fake.stuck = True

    async def main() -> list[float]:
        took = []
        for call in (store.put_blocks([5], tokens_of(1)), store.get_blocks([7]),
                     store.exists([7])):
            t = time.perf_counter()
            got: Any = await call
            took.append(time.perf_counter() - t)
            assert got in (0, [None], [False])
        return took

    try:
        took = asyncio.run(main())
        # each waited its limit and no longer (the host may be loaded: 1 s of slack)
        assert all(TIMEOUT_S <= t < TIMEOUT_S + 1.0 for t in took), took
        assert store.timeouts == 3 and store.stuck == 3  # still holding their threads
    finally:
        fake.release.set()
    wait_unstuck(store)  # they ended: their threads are free again
    assert store.name(5) in fake.objects  # the stuck put did finish, late


def test_with_every_thread_stuck_the_store_is_skipped_at_once() -> None:
    store, fake = client()
    fake.stuck = True

    async def main() -> float:
        # one more than there are threads: that one waits in the queue, and is dropped
        got = await asyncio.gather(*(store.get_blocks([i]) for i in range(store.threads + 1)))
        assert got == [[None]] * (store.threads + 1)
        t = time.perf_counter()
        assert await store.put_blocks([99], tokens_of(1)) == 0
        return time.perf_counter() - t

    try:
        skipped_in = asyncio.run(main())
        assert store.timeouts == store.threads + 1 and store.stuck == store.threads
        assert store.skipped == 1 and skipped_in < TIMEOUT_S  # not queued behind them
        assert store.name(99) not in fake.objects
    finally:
        fake.release.set()
    wait_unstuck(store)
    fake.stuck = False
    # threads free again: the store is used again
    assert asyncio.run(store.put_blocks([99], tokens_of(1))) == 1
