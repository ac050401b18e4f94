"""KV events over real ZeroMQ: wire format, gap recovery through replay, and agreement
between the events and the worker's cache (fed into the core's ``PrefixIndex``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_conductor.index import PrefixIndex
from mooncake_contract.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
)
from mooncake_contract.kvevents.subscriber import KVEventSubscriber
from mooncake_contract.tokenizer import Tokenizer
from worker_fixtures import WorkerProc, run_worker

MODEL = "llama3-70b-sim"
BS = 16
SEED = namespace_seed(MODEL, BS)


async def post(session: aiohttp.ClientSession, w: WorkerProc, path: str, body: Any) -> Any:
    async with session.post(w.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def wait_for(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if await cond():
            return True
        await asyncio.sleep(0.02)
    return await cond()


def test_raw_frames_match_vllm_format(worker: WorkerProc) -> None:
    async def main() -> tuple[list[int], list[list[bytes]]]:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(worker.kv_endpoint)
        await asyncio.sleep(0.3)  # ZeroMQ slow joiner
        frames: list[list[bytes]] = []
        async with aiohttp.ClientSession() as s:
            # new prompts until the subscriber has joined and sees one's BlockStored
            for attempt in range(20):
                tokens = Tokenizer().encode(" ".join(f"alpha{attempt}x{i}" for i in range(40)))
                await post(s, worker, "/v1/completions", {"prompt": tokens, "max_tokens": 1})
                with contextlib.suppress(TimeoutError):
                    while True:
                        msg = await asyncio.wait_for(sub.recv_multipart(), 0.5)
                        frames.append(msg)
                        evs = decode_batch(msg[2]).events
                        if any(isinstance(e, BlockStored) and e.token_ids[:16] == tokens[:16]
                               for e in evs):
                            sub.close(0)
                            ctx.term()
                            return tokens, frames
        raise AssertionError("no KV events received")

    tokens, frames = asyncio.run(main())
    seqs = [decode_seq(f[1]) for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    topic, seq_frame, payload = frames[-1]
    assert topic == b"" and len(seq_frame) == 8
    batch = decode_batch(payload)
    assert encode_batch(batch) == payload  # byte-exact round trip of what the worker sent
    assert payload[:1] == b"\x93" and payload[1:2] == b"\xcb"  # [float64 ts, events, rank]
    assert payload.find(b"\xde\x00\x08\xa4type\xabBlockStored") > 0  # map16 like msgspec
    ev = next(e for e in batch.events if isinstance(e, BlockStored))
    nfull = len(tokens) // BS
    assert ev.block_hashes == block_keys(tokens, BS, SEED)[:nfull]
    assert ev.parent_block_hash is None
    assert ev.token_ids == tokens[: nfull * BS]
    assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None


def test_gap_is_recovered_through_replay() -> None:
    with run_worker("--time-scale", "0") as w:

        async def main() -> KVEventSubscriber:
            got: list[tuple[int, KVEventBatch]] = []
            async with aiohttp.ClientSession() as s:
                # events published before anyone listens: the subscriber will miss them
                for i in range(5):
                    await post(s, w, "/v1/completions",
                               {"prompt": f"early request number {i} " * 8, "max_tokens": 1})
                sub = KVEventSubscriber(w.kv_endpoint, lambda q, b: got.append((q, b)),
                                        replay_endpoint=w.replay_endpoint, expected_seq=0)
                task = asyncio.create_task(sub.run())
                await asyncio.sleep(0.3)
                for i in range(20):  # until the subscriber has joined (slow joiner)
                    await post(s, w, "/v1/completions",
                               {"prompt": f"late one {i} " * 8, "max_tokens": 1})
                    if await wait_for(lambda: _true(len(got) >= 6), 0.5):
                        break
                assert len(got) >= 6
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            seqs = [q for q, _ in got]
            assert seqs == list(range(len(seqs)))
            return sub

        sub = asyncio.run(main())
        assert sub.gaps == 1 and sub.replayed >= 5 and sub.lost == 0


async def _true(v: bool) -> bool:
    return v


def test_replay_socket_protocol(worker: WorkerProc) -> None:
    async def main() -> list[list[bytes]]:
        async with aiohttp.ClientSession() as s:
            await post(s, worker, "/v1/completions", {"prompt": "replay me " * 10, "max_tokens": 1})
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(worker.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 5)
            out.append(msg)
            if msg[2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(0)
        ctx.term()
        return out

    msgs = asyncio.run(main())
    assert msgs[-1] == [b"", b"", b"\xff" * 8, b""]
    body = msgs[:-1]
    assert body and all(len(m) == 4 and m[0] == b"" for m in body)
    assert [decode_seq(m[2]) for m in body] == list(range(len(body)))


def test_events_agree_with_cache_and_prefix_index() -> None:
    """A scripted mix (shared prefixes, chat turns, evictions, a reset) through a small
    cache; the events, fed to the core's PrefixIndex, must equal what the worker holds."""
    with run_worker("--time-scale", "0", "--cache-tokens", "1024", "--max-running", "8") as w:
        index = PrefixIndex(capacity_blocks=1 << 20)
        counts = {"stored": 0, "removed": 0, "cleared": 0}

        def on_batch(_seq: int, batch: KVEventBatch) -> None:
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    counts["stored"] += len(ev.block_hashes)
                    index.store(0, [int(h) for h in ev.block_hashes])  # type: ignore[arg-type]
                elif isinstance(ev, BlockRemoved):
                    counts["removed"] += len(ev.block_hashes)
                    index.remove(0, [int(h) for h in ev.block_hashes])  # type: ignore[arg-type]
                elif isinstance(ev, AllBlocksCleared):
                    counts["cleared"] += 1
                    index.clear(0)

        async def held(s: aiohttp.ClientSession) -> set[int]:
            async with s.get(w.url + "/kv/blocks") as r:
                return set((await r.json())["keys"])

        async def main() -> None:
            sub = KVEventSubscriber(w.kv_endpoint, on_batch, replay_endpoint=w.replay_endpoint,
                                    expected_seq=0)
            task = asyncio.create_task(sub.run())
            await asyncio.sleep(0.3)
            rng = random.Random(7)
            systems = [" ".join(f"sys{j}w{i}" for i in range(rng.randint(20, 90)))
                       for j in range(4)]
            async with aiohttp.ClientSession() as s:

                async def one(i: int) -> None:
                    if i % 3 == 0:
                        msgs = [{"role": "system", "content": rng.choice(systems)},
                                {"role": "user", "content": f"question {i} " * rng.randint(1, 30)}]
                        await post(s, w, "/v1/chat/completions",
                                   {"messages": msgs, "max_tokens": rng.randint(1, 40)})
                    else:
                        prompt = rng.choice(systems) + f" user {i} " * rng.randint(0, 40)
                        await post(s, w, "/v1/completions",
                                   {"prompt": prompt, "max_tokens": rng.randint(1, 40)})

                for round_ in range(3):
                    await asyncio.gather(*(one(round_ * 100 + i) for i in range(30)))
                    if round_ == 1:
                        await post(s, w, "/reset_prefix_cache", {})
                assert await wait_for(lambda: _eq(held(s), index.blocks(0)))
                assert index.blocks(0) == await held(s)
                # the index predicts the worker's prefix hits
                prompt = systems[0] + " probe"
                toks = Tokenizer().encode(prompt)
                predicted = index.match(0, block_keys(toks, BS, SEED))
                r = await post(s, w, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
                cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == min(predicted * BS, len(toks) - 1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert sub.lost == 0

        asyncio.run(main())
        assert counts["removed"] > 0, "the scripted load should evict blocks"
        assert counts["cleared"] == 1


async def _eq(a: Awaitable[set[int]], b: set[int]) -> bool:
    return await a == b


def test_events_json_decoded_form_is_plain(worker: WorkerProc) -> None:
    from mooncake_contract.kvevents.codec import to_plain

    batch = KVEventBatch(1.0, [BlockRemoved([5], "GPU")], None)
    assert json.loads(json.dumps(to_plain(batch))) == [
        1.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}], None
    ]
