"""The store half of the P/D handshake in-process, against a real ``mooncake_master``: the
prefill's handoff puts the prompt's blocks in the store, the decode side loads them
(block by block, checking every block's tokens), skips what it has cached, refuses keys
of another namespace, counts the transferred blocks and sleeps the modelled transfer.

One store client is connected per module and shared by the workers (a connect and close
take about two seconds); each test uses its own token range, so the blocks one test put
never answer another's lookups."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_contract.kvevents.codec import BlockStored
from mooncake_worker.server import Worker
from mooncake_worker.store import BlockStore
from worker_fixtures import Master
from worker_inproc import (
    BS,
    keys_for,
    post,
    prompt,
    published,
    serving,
    settings,
    stored_event,
)

pytestmark = pytest.mark.store


@pytest.fixture(scope="module")
def store(mooncake_master: Master) -> Iterator[BlockStore]:
    s = settings(store_master=mooncake_master.rpc, store_metadata=mooncake_master.metadata)
    client = BlockStore(s, CostModel(s.cost).kv_bytes_per_token)
    asyncio.run(client.connect())
    try:
        yield client
    finally:
        asyncio.run(client.close())


def blocks_of(tokens: list[int], n: int, start: int = 0) -> list[list[int]]:
    return [tokens[i * BS:(i + 1) * BS] for i in range(start, start + n)]


def decode_worker(**kw: Any) -> Worker:
    """A decode-side worker that publishes its KV events (read back from its buffer); serve
    it (its clean-up closes the publisher)."""
    return Worker(settings(kv_events_port=0, **kw))


def test_handoff_puts_the_prompt_blocks_in_the_store(store: BlockStore) -> None:
    tokens = prompt(20_000, 4 * BS + 9)
    keys = keys_for(tokens)

    async def main() -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
        w = Worker(settings())
        async with serving(w, store) as c:
            kvps = []
            for _ in range(2):
                status, body, _ = await post(c, "/v1/completions", {
                    "prompt": tokens, "max_tokens": 4,
                    "kv_transfer_params": {"do_remote_decode": True}})
                assert status == 200
                kvps.append(body["kv_transfer_params"])
        return kvps[0], kvps[1], await store.get_blocks(keys)

    first, again, got = asyncio.run(main())
    assert first["kv_store"] == "mooncake" and first["stored_blocks"] == 4
    assert first["remote_block_keys"] == keys
    assert again["stored_blocks"] == 0  # already in the store: nothing written twice
    assert again["kv_store"] == "mooncake"
    assert got == [(k, b) for k, b in zip(keys, blocks_of(tokens, 4), strict=True)]


def test_decode_loads_the_prefill_blocks_and_announces_them(store: BlockStore) -> None:
    tokens = prompt(21_000, 5 * BS + 4)
    keys = keys_for(tokens)

    async def main() -> tuple[dict[str, Any], dict[str, Any], str, Worker, list[int], int]:
        p, d, ref = Worker(settings()), decode_worker(), Worker(settings())
        async with serving(p, store) as pc:
            _, pbody, _ = await post(pc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}})
        async with serving(ref) as rc:
            _, rbody, _ = await post(rc, "/v1/completions", {"prompt": tokens, "max_tokens": 5})
        async with serving(d, store) as dc:
            status, dbody, _ = await post(dc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 5,
                "kv_transfer_params": pbody["kv_transfer_params"]})
            assert status == 200
            held = (await (await dc.get("/kv/blocks")).json())["keys"]
            again = await d._load_remote_kv(tokens, keys, pbody["kv_transfer_params"])
        return pbody, dbody, rbody["choices"][0]["text"], d, held, again

    pbody, dbody, reference, d, held, again = asyncio.run(main())
    # the decode worker never saw this prompt: its cached tokens came from the store
    assert dbody["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BS
    assert dbody["choices"][0]["text"] == reference
    assert reference.startswith(pbody["choices"][0]["text"])
    assert d.transferred_blocks == 5 and set(keys) <= set(held)
    assert again == 0  # all cached now: nothing to load
    stored = [ev for ev in published(d) if isinstance(ev, BlockStored)]
    assert stored[0] == stored_event(keys, None, tokens[:5 * BS])


def test_load_stops_at_a_missing_block_or_one_whose_tokens_differ(store: BlockStore) -> None:
    wrong = prompt(22_000, 5 * BS + 1)
    gap = prompt(23_000, 5 * BS + 1)
    kw, kg = keys_for(wrong), keys_for(gap)
    other = [t + 1 for t in wrong[2 * BS:3 * BS]]

    async def main() -> tuple[int, int, Worker]:
        # block 2 is under its key but holds other tokens (a collision, a stale object)
        await store.put_blocks(kw, [*blocks_of(wrong, 2), other, *blocks_of(wrong, 2, 3)])
        # block 2 is missing
        await store.put_blocks([*kg[:2], *kg[3:]], [*blocks_of(gap, 2), *blocks_of(gap, 2, 3)])
        d = Worker(settings())
        d.store = store
        a = await d._load_remote_kv(wrong, kw, {"remote_block_keys": kw})
        b = await d._load_remote_kv(gap, kg, {"remote_block_keys": kg})
        return a, b, d

    a, b, d = asyncio.run(main())
    assert (a, b) == (2, 2)
    assert d.transferred_blocks == 4  # counted over both loads
    assert d.engine.cache.held_keys() == {*kw[:2], *kg[:2]}


def test_keys_of_another_namespace_recompute(store: BlockStore) -> None:
    tokens = prompt(24_000, 4 * BS + 2)
    keys = keys_for(tokens)

    async def main() -> list[tuple[int, int]]:
        await store.put_blocks(keys, blocks_of(tokens, 4))
        out = []
        kvps: list[dict[str, Any]] = [
            {"remote_block_keys": keys_for(tokens, salt="other")},  # foreign: refuse
            {"remote_block_keys": [*keys, 12345]},  # longer than ours: not our prompt
            {"remote_block_keys": keys[:2]},  # a shorter prompt's keys: a prefix
            {"remote_block_keys": []},
            {}]
        for kvp in kvps:
            d = Worker(settings())
            d.store = store
            n = await d._load_remote_kv(tokens, keys, kvp)
            out.append((n, d.transferred_blocks))
        return out

    assert asyncio.run(main()) == [(0, 0), (0, 0), (4, 4), (4, 4), (4, 4)]


def test_decode_over_http_with_foreign_keys_computes_everything(store: BlockStore) -> None:
    tokens = prompt(25_000, 3 * BS + 2)
    keys = keys_for(tokens)

    async def main() -> dict[str, Any]:
        await store.put_blocks(keys, blocks_of(tokens, 3))
        d = decode_worker()
        async with serving(d, store) as dc:
            _, body, _ = await post(dc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True,
                                       "remote_block_keys": keys_for(tokens, model="m2")}})
        return body

    assert asyncio.run(main())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cached_prefix_is_skipped_and_the_rest_loaded(store: BlockStore) -> None:
    tokens = prompt(26_000, 6 * BS + 3)
    keys = keys_for(tokens)

    async def main() -> tuple[int, Worker]:
        await store.put_blocks(keys, blocks_of(tokens, 6))
        d = decode_worker()
        async with serving(d, store) as dc:
            # the decode worker computed the first two blocks itself, earlier
            _, body, _ = await post(dc, "/v1/completions",
                                    {"prompt": tokens[:2 * BS + 1], "max_tokens": 1})
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            n = await d._load_remote_kv(tokens, keys, {"remote_block_keys": keys})
        return n, d

    n, d = asyncio.run(main())
    assert n == 4 and d.transferred_blocks == 4
    assert d.engine.cache.held_keys() >= set(keys)
    stored = [ev for ev in published(d) if isinstance(ev, BlockStored)]
    assert stored[-1] == stored_event(keys[2:], keys[1], tokens[2 * BS:6 * BS])


def test_both_flags_make_a_prefill_half_that_loads_nothing(store: BlockStore) -> None:
    tokens = prompt(27_000, 3 * BS + 2)
    keys = keys_for(tokens)

    async def main() -> tuple[dict[str, Any], Worker]:
        await store.put_blocks(keys, blocks_of(tokens, 3))
        d = decode_worker()
        async with serving(d, store) as dc:
            _, body, _ = await post(dc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 4,
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": True,
                                       "remote_block_keys": keys}})
        return body, d

    body, d = asyncio.run(main())
    assert d.transferred_blocks == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == 1
    assert body["kv_transfer_params"]["stored_blocks"] == 0  # the blocks were there already


def test_transfer_sleeps_the_modelled_time_scaled(store: BlockStore) -> None:
    tokens = prompt(28_000, 4 * BS + 1)
    keys = keys_for(tokens)
    scale = 0.3 / CostModel().transfer_time(4 * BS)  # a 0.3 s sleep

    async def main() -> tuple[int, float]:
        await store.put_blocks(keys, blocks_of(tokens, 4))
        d = Worker(settings(time_scale=scale))
        d.store = store
        t0 = time.monotonic()
        n = await d._load_remote_kv(tokens, keys, {"remote_block_keys": keys})
        return n, time.monotonic() - t0

    n, took = asyncio.run(main())
    assert n == 4
    assert 0.3 * 0.95 <= took <= 0.3 * 2 + 0.5  # upper: slack for a loaded machine


def test_nothing_to_load_is_zero_blocks(store: BlockStore) -> None:
    """A prompt shorter than a block, and one the store never saw, load nothing."""
    unseen = prompt(29_000, 3 * BS + 1)
    short = prompt(29_500, BS - 1)

    async def main() -> tuple[int, int, Worker]:
        d = Worker(settings())
        d.store = store
        a = await d._load_remote_kv(short, [], {})
        b = await d._load_remote_kv(unseen, keys_for(unseen), {"remote_block_keys": []})
        return a, b, d

    a, b, d = asyncio.run(main())
    assert (a, b, d.transferred_blocks) == (0, 0, 0)
    assert not d.engine.cache.cached
