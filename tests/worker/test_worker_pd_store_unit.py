"""The store half of the P/D handshake in-process, against a real ``mooncake_master``: a
prefill half with a transfer id puts the prompt's blocks in the store (without one, as
vLLM's MooncakeConnector, it holds nothing), the decode half told where to pull loads
them (block by block, checking every block's tokens, under its own block keys: an engine
of another namespace finds none), skips what it has cached, counts the transferred blocks
and sleeps the modelled transfer.

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


#: the gateway's two halves (mooncake_gateway.handshake: vLLM's MooncakeConnector shape)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "x-1"}
REMOTE_PREFILL = {"do_remote_decode": False, "do_remote_prefill": True,
                  "remote_engine_id": "prefill-0", "remote_bootstrap_addr": "http://p:8998",
                  "transfer_id": "x-1"}


def decode_worker(**kw: Any) -> Worker:
    """A decode-side worker that publishes its KV events (read back from its buffer); serve
    it (its clean-up closes the publisher)."""
    return Worker(settings(kv_events_port=0, **kw))


def test_handoff_puts_the_prompt_blocks_in_the_store(store: BlockStore) -> None:
    tokens = prompt(20_000, 4 * BS + 9)
    keys = keys_for(tokens)

    async def main() -> tuple[list[Any], list[Any], int]:
        w = Worker(settings())
        async with serving(w, store) as c:
            answers = []
            for _ in range(2):
                status, body, _ = await post(c, "/v1/completions", {
                    "prompt": tokens, "max_tokens": 4, "kv_transfer_params": REMOTE_DECODE})
                assert status == 200
                answers.append(body["kv_transfer_params"])
        again = await store.put_blocks(keys, blocks_of(tokens, 4))
        return answers, await store.get_blocks(keys), again

    answers, got, again = asyncio.run(main())
    assert answers == [None, None]  # no parameters of its own, as vLLM answers
    assert got == [(k, b) for k, b in zip(keys, blocks_of(tokens, 4), strict=True)]
    assert again == 0  # already in the store: nothing to write


def test_a_prefill_half_without_a_transfer_id_holds_nothing(store: BlockStore) -> None:
    """vLLM's MooncakeConnector sends nothing for a request without ``transfer_id``
    ("Missing transfer_id in kv_transfer_params from router!"): neither does ours."""
    tokens = prompt(20_500, 3 * BS + 1)

    async def main() -> list[Any]:
        async with serving(Worker(settings()), store) as c:
            status, _, _ = await post(c, "/v1/completions", {
                "prompt": tokens, "max_tokens": 4,
                "kv_transfer_params": {"do_remote_decode": True}})
            assert status == 200
        return await store.get_blocks(keys_for(tokens))

    assert asyncio.run(main()) == [None, None, None]


def test_decode_loads_the_prefill_blocks_and_announces_them(store: BlockStore) -> None:
    tokens = prompt(21_000, 5 * BS + 4)
    keys = keys_for(tokens)

    async def main() -> tuple[dict[str, Any], dict[str, Any], str, Worker, list[int], int]:
        p, d, ref = Worker(settings()), decode_worker(), Worker(settings())
        async with serving(p, store) as pc:
            _, pbody, _ = await post(pc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE})
        async with serving(ref) as rc:
            _, rbody, _ = await post(rc, "/v1/completions", {"prompt": tokens, "max_tokens": 5})
        async with serving(d, store) as dc:
            status, dbody, _ = await post(dc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 5, "kv_transfer_params": REMOTE_PREFILL})
            assert status == 200
            held = (await (await dc.get("/kv/blocks")).json())["keys"]
            again = await d._load_remote_kv(tokens, keys)
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
        a = await d._load_remote_kv(wrong, kw)
        b = await d._load_remote_kv(gap, kg)
        return a, b, d

    a, b, d = asyncio.run(main())
    assert (a, b) == (2, 2)
    assert d.transferred_blocks == 4  # counted over both loads
    assert d.engine.cache.held_keys() == {*kw[:2], *kg[:2]}


def test_an_engine_of_another_namespace_finds_nothing_and_recomputes(
        store: BlockStore) -> None:
    tokens = prompt(24_000, 4 * BS + 2)
    keys = keys_for(tokens)

    async def main() -> list[tuple[int, int]]:
        await store.put_blocks(keys, blocks_of(tokens, 4))
        out = []
        for salt in ("other", ""):  # the prefill's blocks are under the unsalted keys
            d = Worker(settings(cache_salt=salt))
            d.store = store
            n = await d._load_remote_kv(tokens, keys_for(tokens, salt=salt))
            out.append((n, d.transferred_blocks))
        return out

    assert asyncio.run(main()) == [(0, 0), (4, 4)]


@pytest.mark.parametrize("missing", ["remote_engine_id", "remote_bootstrap_addr",
                                     "transfer_id"])
def test_a_decode_half_without_a_pull_parameter_recomputes(store: BlockStore,
                                                           missing: str) -> None:
    """vLLM's MooncakeConnector ignores ``do_remote_prefill`` without all three ("Got
    invalid KVTransferParams"): so does ours."""
    tokens = prompt(24_500 + len(missing), 3 * BS + 2)

    async def main() -> dict[str, Any]:
        await store.put_blocks(keys_for(tokens), blocks_of(tokens, 3))
        params = {k: v for k, v in REMOTE_PREFILL.items() if k != missing}
        async with serving(decode_worker(), store) as dc:
            _, body, _ = await post(dc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 2, "kv_transfer_params": params})
        return body

    assert asyncio.run(main())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_decode_over_http_of_another_model_computes_everything(store: BlockStore) -> None:
    tokens = prompt(25_000, 3 * BS + 2)

    async def main() -> dict[str, Any]:
        await store.put_blocks(keys_for(tokens, model="m2"), blocks_of(tokens, 3))
        d = decode_worker()
        async with serving(d, store) as dc:
            _, body, _ = await post(dc, "/v1/completions", {
                "prompt": tokens, "max_tokens": 2, "kv_transfer_params": REMOTE_PREFILL})
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
            n = await d._load_remote_kv(tokens, keys)
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
                "kv_transfer_params": {**REMOTE_PREFILL, "do_remote_decode": True}})
        return body, d

    body, d = asyncio.run(main())
    assert d.transferred_blocks == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == 1
    assert body["kv_transfer_params"] is None


def timed_load(store: BlockStore, tokens: list[int], transfer_s: float,
               via: Any = None) -> tuple[int, float]:
    """Put ``tokens``' 4 full blocks, then time a decode worker's load of them (through
    ``via`` in place of the store when given) with a modelled transfer of ``transfer_s``."""
    keys = keys_for(tokens)
    scale = transfer_s / CostModel().transfer_time(4 * BS)

    async def main() -> tuple[int, float]:
        await store.put_blocks(keys, blocks_of(tokens, 4))
        d = Worker(settings(time_scale=scale))
        d.store = via or store
        t0 = time.monotonic()
        n = await d._load_remote_kv(tokens, keys)
        return n, time.monotonic() - t0

    return asyncio.run(main())


def test_transfer_sleeps_the_modelled_time_scaled(store: BlockStore) -> None:
    n, took = timed_load(store, prompt(28_000, 4 * BS + 1), 0.3)
    assert n == 4
    assert 0.3 * 0.95 <= took <= 0.3 * 2 + 0.5  # upper: slack for a loaded machine


class _Slow:
    """The shared store client, with a recorder on its writes and ``get_delay_s`` added to
    each read."""

    def __init__(self, store: BlockStore, worker: Worker | None = None,
                 get_delay_s: float = 0.0) -> None:
        self.store, self.worker, self.get_delay_s = store, worker, get_delay_s
        self.put_while_running: list[bool] = []

    async def put_blocks(self, keys: Any, tokens: Any) -> int:
        if self.worker is not None:  # is the prompt these blocks open in the running batch?
            self.put_while_running.append(any(seq.prompt[:BS] == list(tokens[0])
                                              for seq in self.worker.engine.running))
        return await self.store.put_blocks(keys, tokens)

    async def get_blocks(self, keys: Any) -> Any:
        await asyncio.sleep(self.get_delay_s)
        return await self.store.get_blocks(keys)


def test_the_store_writes_run_beside_the_prefill(store: BlockStore) -> None:
    """A prefill half writes its blocks while its prefill is still modelled as running, as
    an engine writes KV while it computes: their wall time does not come after it."""
    tokens = prompt(30_000, 6 * BS + 2)
    scale = 0.4 / CostModel().prefill_time(len(tokens))  # a 0.4 s prefill

    async def main() -> tuple[int, list[bool]]:
        p = Worker(settings(time_scale=scale))
        slow = _Slow(store, worker=p)
        async with serving(p) as c:
            p.store = slow  # type: ignore[assignment]
            status, _, _ = await post(c, "/v1/completions", {
                "prompt": tokens, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE})
        return status, slow.put_while_running

    status, during = asyncio.run(main())
    assert status == 200 and during == [True]
    got = asyncio.run(store.get_blocks(keys_for(tokens)))
    assert all(g is not None for g in got)


def test_a_queued_prefill_writes_its_blocks_only_once_it_runs(store: BlockStore) -> None:
    """Two prefill halves at once on an engine that runs one prompt at a time: each writes
    its blocks while its own prefill runs, not while it waits behind the other."""
    first, second = prompt(32_000, 5 * BS), prompt(32_500, 5 * BS)
    scale = 0.2 / CostModel().prefill_time(len(first))  # 0.2 s each

    async def main() -> list[bool]:
        p = Worker(settings(time_scale=scale, max_running=1))
        slow = _Slow(store, worker=p)
        async with serving(p) as c:
            p.store = slow  # type: ignore[assignment]
            answers = await asyncio.gather(*(post(c, "/v1/completions", {
                "prompt": t, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE})
                for t in (first, second)))
        assert [a[0] for a in answers] == [200, 200]
        return slow.put_while_running

    assert asyncio.run(main()) == [True, True]


def test_the_stores_wall_time_counts_in_the_modelled_transfer(store: BlockStore) -> None:
    """The modelled transfer is a deadline from the start of the store read: a read slower
    than the model is not followed by the model's whole sleep (0.6 s, not 0.9 s)."""
    n, took = timed_load(store, prompt(31_000, 4 * BS + 1), 0.3,
                         via=_Slow(store, get_delay_s=0.6))
    assert n == 4
    assert 0.6 <= took < 0.9 * 0.95


def test_nothing_to_load_is_zero_blocks(store: BlockStore) -> None:
    """A prompt shorter than a block, and one the store never saw, load nothing."""
    unseen = prompt(29_000, 3 * BS + 1)
    short = prompt(29_500, BS - 1)

    async def main() -> tuple[int, int, Worker]:
        d = Worker(settings())
        d.store = store
        a = await d._load_remote_kv(short, [])
        b = await d._load_remote_kv(unseen, keys_for(unseen))
        return a, b, d

    a, b, d = asyncio.run(main())
    assert (a, b, d.transferred_blocks) == (0, 0, 0)
    assert not d.engine.cache.cached
