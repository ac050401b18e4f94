"""An in-process worker for fast tests: a :class:`Worker` built from its settings, served
over real HTTP on 127.0.0.1 by aiohttp's test server, plus helpers to read what it
published. Unlike the subprocess fixtures, mutation testing sees the code these tests run.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_contract.kvevents.codec import BlockStored, KVEvent, decode_batch
from mooncake_worker.server import Worker
from mooncake_worker.settings import WorkerSettings
from mooncake_worker.store import BlockStore

HOST = "127.0.0.1"
MODEL = "llama3-70b-sim"
BS = 16


def settings(**kw: Any) -> WorkerSettings:
    """A fast worker (time-scale 0, a small cache) unless ``kw`` says otherwise."""
    base: dict[str, Any] = {"time_scale": 0, "block_size": BS, "cache_tokens": BS * 64,
                            "max_model_len": 4096, "port": 8123}
    base.update(kw)
    return WorkerSettings(**base)


def prompt(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start`` (each test picks its own range, so that
    blocks a shared store already holds never leak from one test into another)."""
    return list(range(start, start + n))


def keys_for(tokens: Sequence[int], model: str = MODEL, bs: int = BS, salt: str = "") -> list[int]:
    """The block keys, computed here from the shared hashing, not by the worker."""
    return block_keys(tokens, bs, namespace_seed(model, bs, "", salt))


@contextlib.asynccontextmanager
async def serving(worker: Worker, store: BlockStore | None = None) -> AsyncIterator[TestClient[Any, Any]]:  # noqa: E501
    """Serve ``worker`` on a free 127.0.0.1 port for the block.

    ``store`` is an already connected client shared by a test module: it is attached
    after start-up and detached before clean-up, so the worker neither connects it again
    nor closes it (a store client's close takes about two seconds)."""
    server = TestServer(worker.app, host=HOST, port=0)  # handler cancellation on, as in serve()
    async with TestClient(server) as client:
        worker.store = store
        try:
            yield client
        finally:
            worker.store = None


async def post(client: TestClient[Any, Any], path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:  # noqa: E501
    """POST a JSON body; (status, JSON answer, headers)."""
    resp = await client.post(path, json=body)
    return resp.status, await resp.json(), dict(resp.headers)


def published(worker: Worker) -> list[KVEvent]:
    """Every KV event the worker's publisher sent so far, in order."""
    assert worker.publisher is not None
    return [ev for _seq, payload in worker.publisher.buffer for ev in decode_batch(payload).events]


def stored_event(keys: Sequence[int], parent: int | None, tokens: Sequence[int],
                 bs: int = BS) -> BlockStored:
    """The ``BlockStored`` a worker announces for ``keys`` (a GPU medium, no LoRA)."""
    hashes: list[int | bytes] = [*keys]
    return BlockStored(hashes, parent, list(tokens), bs, None, "GPU", None)
