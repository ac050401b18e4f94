"""The engine model in-process: calibrated timing, continuous batching, chunked prefill,
block accounting and LRU eviction."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from mooncake_conductor.cost import CostModel
from mooncake_conductor.stepcost import chunked_prefill_time, decode_share_time, mixed_step_time
from mooncake_contract.kvevents.codec import BlockRemoved, BlockStored, KVEvent
from mooncake_worker.engine import Engine, EngineObserver, QueueFull, TooLarge
from mooncake_worker.kvcache import PrefixCache
from mooncake_worker.settings import WorkerSettings

COST = CostModel()


def engine(**kw: object) -> Engine:
    return Engine(WorkerSettings(**kw))  # type: ignore[arg-type]


async def run(e: Engine, prompt: list[int], max_tokens: int) -> float:
    t0 = time.monotonic()
    seq = e.submit(prompt, max_tokens)
    assert seq.done is not None
    await seq.done
    return time.monotonic() - t0


def test_prefill_and_decode_time_follow_the_cost_model() -> None:
    scale = 0.5

    async def main() -> tuple[float, float]:
        e = engine(time_scale=scale)
        e.start()
        try:
            ttft_only = await run(e, list(range(300, 4300)), 1)
            with_decode = await run(e, list(range(10_000, 10_100)), 21)
        finally:
            await e.stop()
        return ttft_only, with_decode

    ttft_only, with_decode = asyncio.run(main())
    want = COST.prefill_time(4000) * scale
    assert want * 0.95 <= ttft_only <= want * 2 + 0.25  # upper: slack for a loaded machine
    want2 = (COST.prefill_time(100) + 20 * COST.decode_step_time(1, 110)) * scale
    assert want2 * 0.95 <= with_decode <= want2 * 2 + 0.25


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_prefill_noise_scales_each_request_by_its_own_seeded_factor(sigma: float) -> None:
    """A step's prefill seconds are the cost model's times the request's log-normal factor,
    drawn from the seeded stream in admission order (sigma 0: the model exactly)."""
    async def main() -> list[float]:
        e = engine(time_scale=0, prefill_noise=sigma, noise_seed=7)
        out = []
        for i in range(3):
            e.submit(list(range(1000 * (i + 1), 1000 * (i + 1) + 2000)), 1)
            out.append(e.step_plan())
            e.running.clear()
        return out

    steps = asyncio.run(main())
    draws = random.Random(7)
    for got in steps:
        factor = draws.lognormvariate(0.0, sigma) if sigma else 1.0
        assert got == pytest.approx(factor * COST.prefill_time(2000))
    assert (len(set(steps)) == 3) == bool(sigma)


@pytest.mark.parametrize("pulled", [False, True])
def test_a_pulled_prompt_recomputes_its_last_token_in_the_decode_step(pulled: bool) -> None:
    """The decode half of a P/D pair holds every full block of its prompt (pulled from the
    store); the partial last block came with the transfer. Its first step is one more row
    of the decode batch beside a running sequence, as vLLM schedules the recomputed last
    token; a prompt that was not pulled computes its uncached tail as a prefill chunk."""
    prompt = list(range(5000, 5000 + 16 * 40 + 5))  # 40 full blocks and a partial one

    async def main() -> tuple[float, float]:
        e = engine(time_scale=0)
        e.insert_blocks(e.keys_of(prompt)[:40], None, [prompt[i * 16:(i + 1) * 16]
                                                       for i in range(40)])
        other = e.submit(list(range(90_000, 90_100)), 50)
        e.step_plan()  # the other one's prefill
        e.step_emit()
        seq = e.submit(prompt, 5, pulled=pulled)
        step = e.step_plan()
        assert other.computed == 100 and seq.cached_tokens == 16 * 40
        return step, seq.computed

    step, computed = asyncio.run(main())
    n = len(prompt)
    assert computed == n
    if pulled:
        assert step == pytest.approx(COST.decode_step_time(2, n + 101))
    else:
        # one pass: the chunk's prefill plus what the running decode adds to it
        assert step == pytest.approx(COST.prefill_time(n, 16 * 40, 16 * 40)
                                     + decode_share_time(COST, 1, 101))
        assert step < (COST.prefill_time(n, 16 * 40, 16 * 40)
                       + COST.decode_step_time(1, 101))


def test_continuous_batching_runs_sequences_together() -> None:
    scale = 1.0

    async def main() -> float:
        e = engine(time_scale=scale)
        e.start()
        t0 = time.monotonic()
        seqs = [e.submit([500 + i] * 32, 30) for i in range(8)]
        await asyncio.gather(*(s.done for s in seqs if s.done is not None))
        await e.stop()
        return time.monotonic() - t0

    elapsed = asyncio.run(main())
    prefill = mixed_step_time(COST, 0, 0, 8 * COST.flops(32), 8 * 32)  # one pass for all 8
    one = (prefill + 29 * COST.decode_step_time(8, 8 * 62)) * scale
    assert elapsed < one * 3  # sequential service would take about 8 times as long
    assert elapsed > one * 0.9


def test_chunked_prefill_splits_the_prompt() -> None:
    async def main() -> int:
        e = engine(time_scale=0, chunked_prefill_tokens=256)
        e.start()
        await run(e, list(range(1000, 2000)), 1)
        await e.stop()
        return e.steps

    assert asyncio.run(main()) == 4  # ceil(1000 / 256) prefill steps, first token in the last


def test_prompts_admitted_together_are_computed_in_arrival_order() -> None:
    """With a step budget, a prompt admitted behind another waits for its first chunk:
    ``computing`` (what the P/D store write waits for) comes then, not at admission; and
    the first prompt's answer does not wait for the second's compute (vLLM's FCFS chunks,
    not one step for every admitted prompt)."""
    async def main() -> None:
        e = engine(time_scale=0, chunked_prefill_tokens=256)
        first = e.submit(list(range(1000, 1500)), 1)
        second = e.submit(list(range(3000, 3500)), 1)
        e.step_plan()  # both admitted; 256 tokens of the first
        assert first.computing.is_set() and not second.computing.is_set()
        e.step_emit()
        e.step_plan()  # the first's last 244 tokens and 12 of the second
        assert second.computing.is_set()
        e.step_emit()
        assert first.finished and not second.finished

    asyncio.run(main())


@pytest.mark.parametrize("sigma", [0.0, 0.5])
def test_prompts_in_one_step_are_one_pass(sigma: float) -> None:
    """Chunks of several prompts in one step are one forward pass, as in vLLM: one fixed
    cost and the MFU of all their new tokens, each prompt's FLOPs weighed by its own
    noise factor (not one pass per prompt, which costs more)."""
    lengths = (1000, 3000, 2000)

    async def main() -> tuple[float, list[float]]:
        e = engine(time_scale=0, prefill_noise=sigma, noise_seed=3)
        seqs = [e.submit(list(range(10_000 * (i + 1), 10_000 * (i + 1) + n)), 1)
                for i, n in enumerate(lengths)]
        step = e.step_plan()
        assert all(s.computed == len(s.prompt) for s in seqs)
        return step, [s.noise for s in seqs]

    step, noise = asyncio.run(main())
    work = [COST.flops(n) for n in lengths]
    factor = sum(f * w for f, w in zip(noise, work, strict=True)) / sum(work)
    assert step == pytest.approx(factor * mixed_step_time(COST, 0, 0, sum(work), sum(lengths)))
    if not sigma:
        assert step < 0.9 * sum(COST.prefill_time(n) for n in lengths)


@pytest.mark.parametrize("cached_blocks", [0, 300])
def test_a_long_prompt_alone_takes_the_chunked_prefill_time(cached_blocks: int) -> None:
    """The seam the simulator's ``engine_chunk_tokens`` stands on: one prompt longer than
    the step budget, alone on a worker, takes ``chunked_prefill_time`` over its steps."""
    prompt = list(range(50_000, 50_000 + 20_000))

    async def main() -> tuple[float, int]:
        e = engine(time_scale=0)
        if cached_blocks:
            e.insert_blocks(e.keys_of(prompt)[:cached_blocks], None,
                            [prompt[i * 16:(i + 1) * 16] for i in range(cached_blocks)])
        seq = e.submit(prompt, 1)
        total = 0.0
        while not seq.finished:
            total += e.step_plan()
            e.step_emit()
        return total, seq.cached_tokens

    total, cached = asyncio.run(main())
    assert cached == 16 * cached_blocks
    budget = WorkerSettings().chunked_prefill_tokens
    assert total == pytest.approx(chunked_prefill_time(COST, len(prompt), cached, budget,
                                                       cached_in_hbm=cached))


def test_a_prompt_with_nothing_to_compute_counts_as_computing_once_admitted() -> None:
    async def main() -> None:
        e = engine(time_scale=0, chunked_prefill_tokens=256)
        seq = e.submit([], 1)
        e.step_plan()
        assert seq.computing.is_set()

    asyncio.run(main())


def test_time_scale_zero_never_sleeps() -> None:
    async def main() -> float:
        e = engine(time_scale=0)
        e.start()
        took = await run(e, list(range(300, 8300)), 500)
        await e.stop()
        return took

    assert asyncio.run(main()) < 2.0  # modelled: ~8.7 s


class Collect(EngineObserver):
    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.queries: list[tuple[int, int]] = []

    def on_events(self, events: list[KVEvent]) -> None:
        self.events.extend(events)

    def on_prefix_query(self, queried: int, hit: int) -> None:
        self.queries.append((queried, hit))


def test_prefix_reuse_counts_and_eviction_order() -> None:
    obs = Collect()

    async def main() -> Engine:
        e = Engine(WorkerSettings(time_scale=0, cache_tokens=16 * 12, block_size=16), obs)
        e.start()
        a = list(range(1000, 1064))  # 4 blocks
        b = list(range(2000, 2064))
        await run(e, a, 1)
        await run(e, a, 1)  # reuses a's 4 blocks (63 tokens: the last one is recomputed)
        await run(e, b, 1)
        assert obs.queries == [(64, 0), (64, 63), (64, 0)]
        assert not any(isinstance(ev, BlockRemoved) for ev in obs.events)
        c = list(range(3000, 3064))
        await run(e, c, 49)  # needs 8 blocks, 4 blank: evicts the least recently used (a's)
        removed = [h for ev in obs.events if isinstance(ev, BlockRemoved)
                   for h in ev.block_hashes]
        assert sorted(removed) == sorted(e.keys_of(a))  # type: ignore[type-var]
        held = e.cache.held_keys()
        assert set(e.keys_of(b)) <= held
        assert not set(e.keys_of(a)) & held
        await e.stop()
        return e

    e = asyncio.run(main())
    assert e.cache.used == 0 and e.cache.reserved == 0


def test_queue_full_and_too_large() -> None:
    async def main() -> None:
        e = engine(time_scale=0, max_waiting=2, max_running=1, cache_tokens=160)
        e.submit([1] * 10, 1)  # will run at once
        e.submit([1] * 10, 1)
        e.submit([1] * 10, 1)
        with pytest.raises(QueueFull):
            e.submit([1] * 10, 1)
        with pytest.raises(TooLarge):
            e.submit([1] * 150, 20)
        await e.stop()

    asyncio.run(main())


def test_random_load_keeps_block_accounting_consistent() -> None:
    rng = random.Random(3)

    obs = Collect()

    async def main() -> Engine:
        e = Engine(WorkerSettings(time_scale=0, cache_tokens=16 * 40, max_running=6), obs)
        e.start()
        prefixes = [[rng.randrange(256, 5000) for _ in range(rng.randint(10, 120))]
                    for _ in range(5)]
        seqs = []
        for _ in range(80):
            p = rng.choice(prefixes) + [rng.randrange(256, 5000)
                                        for _ in range(rng.randint(0, 100))]
            seqs.append(e.submit(p, rng.randint(1, 60)))
            if rng.random() < 0.2:
                await asyncio.sleep(0)
            if rng.random() < 0.1:
                e.abort(rng.choice(seqs))
        await asyncio.gather(*(s.done for s in seqs if s.done is not None))
        await e.stop()
        return e

    e = asyncio.run(main())
    c: PrefixCache = e.cache
    assert c.used == 0 and c.reserved == 0
    assert len(c.lru) == len(c.cached) <= c.capacity
    # every announced block is held, every held block was announced (net of removals)
    held: set[int] = set()
    for ev in obs.events:
        if isinstance(ev, BlockStored):
            held |= {int(h) for h in ev.block_hashes}  # type: ignore[arg-type]
        elif isinstance(ev, BlockRemoved):
            held -= {int(h) for h in ev.block_hashes}  # type: ignore[arg-type]
    assert held == set(c.cached)
