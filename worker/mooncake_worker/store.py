"""KV handoff through a real Mooncake Store (``mooncake-transfer-engine-non-cuda``).

Each full block is one store object under ``<key_prefix><block key as 16 hex digits>``.
Its payload is a small header (magic ``MCKV1``, the block key as u64 LE, the token
count as u32 LE, the token ids as u32 LE) padded with zeros to
``block_size * kv_bytes_per_token * store_payload_scale`` bytes (real KV is
``kv_bytes_per_token`` per token; the scale keeps tests small). A reader checks the
header against the tokens it expects, so a stale or foreign object is never used.

The transfer engine is pinned to loopback-or-configured ``store_local_hostname``
(``MC_TCP_BIND_ADDRESS`` is set to it before the library is loaded). All store calls
block, so they run on this client's own ``store_calls_in_flight`` threads, each binding
call carrying at most ``store_batch_blocks`` blocks. Both bounds are there because the
binding (``mooncake-transfer-engine-non-cuda`` 0.3.13.post1, TCP) fails transfers once a
client has more than about a thousand objects in flight. Measured on one host: six
concurrent batch calls of 1,000 objects each lost most of them (transfer error -800), and
so did 256-object calls sixteen at a time, and, in part, eight at a time; 16 x 4,000
objects as 256-object calls, four at a time, all arrived. Splitting a 2,000-block read
into 256-block calls took it from 0.05 s to 0.06 s.

A request waits for one call (queue included) at most ``store_timeout_s``: the binding
can wait for ever (an RPC or a transfer to a peer that stopped answering: seen after a
prefill engine that lends a segment was SIGSTOPped, with every store thread of the other
prefill engine still waiting 100 s after it resumed). A call past its limit is left to
finish in its thread, and while such calls take every thread the store is skipped at
once: either way the handoff degrades to recomputation, as when a call fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .settings import WorkerSettings

log = logging.getLogger(__name__)
MAGIC = b"MCKV1"
_HEAD = struct.Struct("<5sQI")
#: pause between connection attempts to a store that is not up yet
CONNECT_RETRY_S = 0.5
T = TypeVar("T")


class StoreError(RuntimeError):
    pass


class StoreUnavailable(StoreError):
    """A store call did not end in time, or was not made (every store thread is stuck)."""


def encode_payload(key: int, tokens: Sequence[int], size: int) -> bytes:
    body = _HEAD.pack(MAGIC, key, len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens)
    return body + bytes(max(0, size - len(body)))


def decode_payload(data: bytes) -> tuple[int, list[int]] | None:
    if len(data) < _HEAD.size:
        return None
    magic, key, n = _HEAD.unpack_from(data)
    if magic != MAGIC or len(data) < _HEAD.size + 4 * n:
        return None
    return key, list(struct.unpack_from(f"<{n}I", data, _HEAD.size))


class BlockStore:
    """Async façade over ``MooncakeDistributedStore`` for KV blocks."""

    def __init__(self, settings: WorkerSettings, kv_bytes_per_token: int) -> None:
        self.settings = settings
        self.payload_bytes = max(
            _HEAD.size + 4 * settings.block_size,
            int(settings.block_size * kv_bytes_per_token * settings.store_payload_scale),
        )
        self._store: Any = None
        self.puts = 0
        self.gets = 0
        #: calls given up after ``store_timeout_s``, and calls not made (threads all stuck)
        self.timeouts = 0
        self.skipped = 0
        #: store threads: while calls stuck in the binding take all of them the store is
        #: skipped, so a stall never queues the engine's requests behind it
        self.threads = settings.store_calls_in_flight
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.threads, thread_name_prefix="mooncake-store")
        self._lock = threading.Lock()
        self._stuck = 0  # calls given up that still hold a store thread

    @property
    def stuck(self) -> int:
        """Calls given up after ``store_timeout_s`` that still run in their threads."""
        return self._stuck

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a store thread, waiting (queue included) at most
        ``store_timeout_s``; raises :class:`StoreUnavailable` when it does not end in time
        (one still queued is dropped; one running goes on in its thread, which stays taken
        until it ends) or when every thread is taken by such calls."""
        if self._stuck >= self.threads:
            self.skipped += 1
            raise StoreUnavailable(f"{what}: all {self.threads} store threads are stuck")
        fut = self._pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut),
                                          self.settings.store_timeout_s)
        except TimeoutError:
            self.timeouts += 1
            if not fut.cancel():  # running: its thread is taken until the binding returns
                with self._lock:
                    self._stuck += 1
                fut.add_done_callback(self._unstick)
            raise StoreUnavailable(
                f"{what}: no answer within {self.settings.store_timeout_s:g} s") from None

    def _unstick(self, _fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    def name(self, key: int) -> str:
        return f"{self.settings.store_key_prefix}{key:016x}"

    def _batches(self, items: Sequence[T]) -> list[Sequence[T]]:
        """``items`` cut into the binding calls that carry them (``store_batch_blocks``
        each at most)."""
        step = self.settings.store_batch_blocks
        return [items[i:i + step] for i in range(0, len(items), step)]

    def _per_batch(self, call: Callable[[list[str]], Sequence[T]], keys: Sequence[int]
                   ) -> list[T]:
        """``call`` on the objects of ``keys``, batch by batch, its answers joined."""
        names = [self.name(k) for k in keys]
        return [r for batch in self._batches(names) for r in call(list(batch))]

    def _setup(self) -> Any:
        s = self.settings
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", s.store_local_hostname)
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(
            s.store_local_hostname,
            s.store_metadata,
            s.store_segment_bytes,
            s.store_buffer_bytes,
            s.store_protocol,
            "",
            s.store_master,
        )
        if rc != 0:
            raise StoreError(f"Mooncake Store setup failed (rc={rc}) for master {s.store_master}")
        return store

    async def connect(self) -> None:
        """Set up the client. The binding holds the GIL and retries an unreachable master
        forever, so the master's RPC port and the metadata server (when it is an HTTP one,
        not ``P2PHANDSHAKE``) are probed first;
        refused connections are retried (a master starting beside this pod), and
        :class:`StoreError` is raised when either does not answer within
        ``store_connect_timeout_s``."""
        s = self.settings
        assert s.store_master is not None and s.store_metadata is not None
        timeout = s.store_connect_timeout_s
        host, _, port = s.store_master.rpartition(":")
        probes = [("master", host, port)]
        if s.store_metadata.startswith(("http://", "https://")):  # else P2PHANDSHAKE
            url = urlsplit(s.store_metadata)
            probes.append(("metadata server", url.hostname or "", str(url.port or 80)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for what, h, p in probes:
            while True:
                left = deadline - loop.time()
                try:
                    _r, w = await asyncio.wait_for(asyncio.open_connection(h, int(p)),
                                                   max(left, CONNECT_RETRY_S))
                    break
                except (OSError, ValueError, TimeoutError) as exc:
                    if isinstance(exc, ValueError) or left <= CONNECT_RETRY_S:
                        raise StoreError(
                            f"Mooncake Store {what} {h}:{p} not reachable: {exc}") from exc
                    await asyncio.sleep(CONNECT_RETRY_S)
            w.close()
        self._store = await asyncio.to_thread(self._setup)

    async def close(self) -> None:
        if self._store is not None:
            store, self._store = self._store, None
            await asyncio.to_thread(store.close)
        self._pool.shutdown(wait=False)

    def _put(self, keys: Sequence[int], tokens: Sequence[Sequence[int]]) -> int:
        return sum(self._put_batch(k, t) for k, t in zip(self._batches(keys),
                                                         self._batches(tokens), strict=True))

    def _put_batch(self, keys: Sequence[int], tokens: Sequence[Sequence[int]]) -> int:
        names = [self.name(k) for k in keys]
        exists = self._store.batch_is_exist(names)
        todo = [i for i, e in enumerate(exists) if e != 1]
        if not todo:
            return 0
        rc = self._store.put_batch(
            [names[i] for i in todo],
            [encode_payload(keys[i], tokens[i], self.payload_bytes) for i in todo],
        )
        if rc != 0:
            # fall back to one object at a time (a batch fails as a whole)
            n = 0
            for i in todo:
                if self._store.put(names[i], encode_payload(keys[i], tokens[i],
                                                            self.payload_bytes)) == 0:
                    n += 1
            return n
        return len(todo)

    async def put_blocks(self, keys: Sequence[int], tokens: Sequence[Sequence[int]]) -> int:
        """Store blocks not yet in the store; returns how many were written (0 when the
        store fails or does not answer in time: the handoff then degrades to
        recomputation, never to an error or a wait without end)."""
        if self._store is None or not keys:
            return 0
        try:
            n = await self._call("put", self._put, keys, tokens)
        except StoreUnavailable as exc:
            log.warning("Mooncake Store %s", exc)
            return 0
        except Exception:  # the binding raises assorted types
            log.exception("Mooncake Store put failed")
            return 0
        self.puts += n
        return n

    def _get(self, keys: Sequence[int]) -> list[bytes]:
        return self._per_batch(self._store.get_batch, keys)

    def _exists(self, keys: Sequence[int]) -> list[int]:
        return [int(r) for r in self._per_batch(self._store.batch_is_exist, keys)]

    async def get_blocks(self, keys: Sequence[int]) -> list[tuple[int, list[int]] | None]:
        """Fetch blocks; ``None`` for every block missing or malformed (all of them when
        the store fails or does not answer in time)."""
        if self._store is None or not keys:
            return [None] * len(keys)
        try:
            raw = await self._call("get", self._get, keys)
        except StoreUnavailable as exc:
            log.warning("Mooncake Store %s", exc)
            return [None] * len(keys)
        except Exception:  # the binding raises assorted types
            log.exception("Mooncake Store get failed")
            return [None] * len(keys)
        out: list[tuple[int, list[int]] | None] = []
        for k, data in zip(keys, raw, strict=True):
            dec = decode_payload(data) if data else None
            out.append(dec if dec is not None and dec[0] == k else None)
        self.gets += sum(1 for o in out if o is not None)
        return out

    async def exists(self, keys: Sequence[int]) -> list[bool]:
        if self._store is None or not keys:
            return [False] * len(keys)
        try:
            res = await self._call("exists", self._exists, keys)
        except StoreUnavailable as exc:
            log.warning("Mooncake Store %s", exc)
            return [False] * len(keys)
        except Exception:  # the binding raises assorted types
            log.exception("Mooncake Store batch_is_exist failed")
            return [False] * len(keys)
        return [r == 1 for r in res]
