"""The KV-event feed keeps the gateway's index true to the engine; after a gap the replay
cannot fill, it keeps what it had (stale where the gap hid a removal, until the engine's
cache turns over: ``kvindex``'s rule) rather than going blind.

A scripted publisher on real ZeroMQ sockets (its sequence numbers, replay buffer and
losses set by the test) feeds an in-process gateway. What the index holds is read from
``/conductor/state`` (per instance: blocks, event counters) and, for what routing sees,
from the explained decision of a request (``x-conductor-explain``: blocks the prefill
instance is matched for)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
from mooncake_contract.kvevents.codec import BlockHash, BlockRemoved, BlockStored

from .scripted import (
    BLOCK,
    MODEL,
    GatewayClient,
    ScriptedEngine,
    ScriptedPublisher,
    engines,
    model,
    prompt_ids,
    running_gateway,
    until,
)

#: health checks often, one failure is down: an engine's absence shows at once
FAST_HEALTH = {"health_interval_s": 0.05, "health_timeout_s": 0.5, "unhealthy_after": 1}


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


class Chain:
    """``blocks`` cached blocks of one prompt, named by the engine's own hashes."""

    def __init__(self, name: int, blocks: int) -> None:
        self.tokens = prompt_ids(blocks * BLOCK, first=name)
        self.hashes: list[BlockHash] = [name * 1000 + i for i in range(blocks)]

    def stored(self, start: int = 0, end: int | None = None) -> BlockStored:
        """Blocks ``start:end`` stored (their parent: the block before ``start``)."""
        end = len(self.hashes) if end is None else end
        parent = self.hashes[start - 1] if start else None
        return BlockStored(self.hashes[start:end], parent,
                           self.tokens[start * BLOCK : end * BLOCK], BLOCK)

    def removed(self) -> BlockRemoved:
        return BlockRemoved(list(self.hashes))


async def _p0(gw: GatewayClient) -> dict[str, Any]:
    return dict((await gw.state())["prefill"][0])


async def _wait_seq(gw: GatewayClient, seq: int) -> dict[str, Any]:
    async def applied() -> dict[str, Any] | None:
        p = await _p0(gw)
        return p if p["events"]["last_seq"] >= seq else None
    got: dict[str, Any] = await until(applied, what=f"KV event {seq} applied")
    return got


async def _matched(gw: GatewayClient, tokens: list[int]) -> int:
    """How many leading blocks of ``tokens`` routing matches on the one prefill instance
    (a request whose prompt is ``tokens`` plus a partial block, explained)."""
    body = {"model": MODEL, "prompt": [*tokens, 5, 6, 7], "max_tokens": 1}
    status, headers, raw = await gw.post("/v1/completions", body,
                                         {"x-conductor-explain": "1"})
    assert status == 200, raw
    decision = json.loads(headers["x-conductor-decision"])
    (cand,) = decision["candidates"]
    return int(cand["matched_blocks"])


def _gateway_with(pub: ScriptedPublisher, p0: ScriptedEngine, d0: ScriptedEngine,
                  **settings: Any) -> AbstractAsyncContextManager[GatewayClient]:
    endpoint = p0.endpoint(**pub.endpoint_fields())
    return running_gateway([model([endpoint], [d0])], **settings)


# -- what a batch says -------------------------------------------------------------------------
def test_stored_blocks_are_indexed_whole_and_of_the_model_block_size_removed_ones_go() -> None:
    async def main() -> None:
        pub = ScriptedPublisher()
        a, b, c = Chain(1, 4), Chain(2, 3), Chain(3, 2)
        try:
            async with engines("p0", "d0") as (p0, d0), _gateway_with(pub, p0, d0) as gw:
                half = BlockStored(b.hashes, None, b.tokens[: 2 * BLOCK + 3], BLOCK)
                other_size = BlockStored(c.hashes, None, c.tokens, BLOCK * 2)
                on_cpu = BlockStored(a.hashes, None, a.tokens, BLOCK, medium="CPU")
                p = await _wait_seq(gw, await pub.publish([half, other_size, on_cpu]))
                ev = p["events"]
                # B: only the blocks its tokens cover; C: another block size, left out
                assert (ev["applied"], ev["stored_blocks"], ev["block_size_mismatches"]) \
                    == (3, 2 + 4, 1)
                assert p["index_blocks"] == 6
                assert await _matched(gw, b.tokens) == 2
                assert await _matched(gw, a.tokens) == 4  # on another tier, still held
                p = await _wait_seq(gw, await pub.publish(
                    [BlockRemoved(a.hashes[2:]), BlockRemoved([999_999])]))
                assert p["events"]["removed_blocks"] == 2 and p["index_blocks"] == 4
                assert await _matched(gw, a.tokens) == 2
        finally:
            await pub.close()

    run(main())


# -- a gap the replay cannot fill --------------------------------------------------------------
async def _instance_series(gw: GatewayClient) -> dict[str, float]:
    """p0's ``instance_kv_events_total`` and ``instance_kv_event_gaps_total``."""
    out = {"events": 0.0, "gaps": 0.0}
    for line in (await gw.text("/metrics")).splitlines():
        if 'instance="p0"' not in line or 'role="prefill"' not in line:
            continue
        if line.startswith("mooncake_gateway_instance_kv_events_total"):
            out["events"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("mooncake_gateway_instance_kv_event_gaps_total"):
            out["gaps"] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize("replay", ["evicted", "none", "silent"])
def test_an_unrecoverable_gap_keeps_the_instance_entries_and_later_events_build_on_them(
        replay: str) -> None:
    """``evicted``: the replay socket answers but no longer buffers the lost batches;
    ``none``: the engine has no replay socket; ``silent``: it never answers."""
    async def main() -> None:
        pub = ScriptedPublisher(replay=replay != "none", answer_replay=replay != "silent")
        a, b, c, d, e = Chain(1, 4), Chain(2, 4), Chain(3, 2), Chain(4, 2), Chain(5, 2)
        try:
            async with engines("p0", "d0") as (p0, d0), \
                    _gateway_with(pub, p0, d0, replay_timeout_s=0.2) as gw:
                # the subscription is live once a batch gets through (earlier ones may not:
                # ZeroMQ's slow joiner; what is missed then is an empty index's loss)
                async def probe() -> bool:
                    seq = await pub.publish([])
                    await asyncio.sleep(0.02)
                    return bool((await _p0(gw))["events"]["last_seq"] == seq)
                await until(probe, what="the subscription is live")
                base = (await _p0(gw))["events"]
                metrics_before = await _instance_series(gw)
                await pub.publish([a.stored()])
                seq = await pub.publish([b.stored(0, 3)])
                p = await _wait_seq(gw, seq)
                assert p["index_blocks"] == 7 and p["events"]["lost"] == base["lost"]
                assert await _matched(gw, a.tokens) == 4
                # lost: A removed, E's root stored, and what else the gateway never knows
                await pub.publish([a.removed()], wire=False, buffered=False)
                await pub.publish([e.stored(0, 1)], wire=False, buffered=False)
                seq = await pub.publish([c.stored()])
                p = await _wait_seq(gw, seq)
                ev = p["events"]
                assert ev["lost"] == base["lost"] + 2
                assert ev["gaps"] == base["gaps"] + 1
                # kept, not forgotten: no reset, A and B's 7 blocks carried over
                assert ev["resets"] == base["resets"]
                assert ev["gaps_kept"] == base["gaps_kept"] + 1
                assert ev["kept_blocks"] == base["kept_blocks"] + 7
                assert ev["unconfirmed_blocks"] == 7
                # /metrics: one gap, and the events applied (A, B, C stored: 3)
                metrics = await _instance_series(gw)
                assert metrics["gaps"] == metrics_before["gaps"] + 1
                assert metrics["events"] == metrics_before["events"] + 3
                # A and B still matched (A is stale: its removal was lost), C in
                assert p["index_blocks"] == 7 + 2
                assert await _matched(gw, a.tokens) == 4
                assert await _matched(gw, b.tokens) == 3
                assert await _matched(gw, c.tokens) == 2
                # a removal after the gap removes; a block extending one from before the
                # gap is indexed; a child of a block stored in the gap is left out (its
                # parent is unknown), not guessed
                await pub.publish([a.removed(), d.stored(0, 1)])
                seq = await pub.publish([d.stored(1, 2), b.stored(3, 4), e.stored(1, 2)])
                p = await _wait_seq(gw, seq)
                assert p["index_blocks"] == 4 + 2 + 2
                assert p["events"]["orphan_blocks"] == base["orphan_blocks"] + 1
                # B's last block vouched for by its child; B's first two and nothing else
                assert p["events"]["unconfirmed_blocks"] == 2
                assert await _matched(gw, a.tokens) == 0
                assert await _matched(gw, b.tokens) == 4
                assert await _matched(gw, d.tokens) == 2
                assert await _matched(gw, e.tokens) == 0
                assert p["routable"]
        finally:
            await pub.close()

    run(main())


def test_a_gap_partly_replayed_keeps_what_came_after_the_loss() -> None:
    """Batches 2 and 3 are gone, 4 and 5 are still buffered: the index keeps what it had
    before the loss, unconfirmed, and adds what the replay brings from after it as
    confirmed (the loss is reported before the replayed batches)."""
    async def main() -> None:
        pub = ScriptedPublisher()
        a, b, c, d = Chain(1, 4), Chain(2, 3), Chain(3, 2), Chain(4, 2)
        try:
            async with engines("p0", "d0") as (p0, d0), \
                    _gateway_with(pub, p0, d0) as gw:
                await pub.publish([a.stored()])
                await _wait_seq(gw, await pub.publish([b.stored(0, 1)]))
                await pub.publish([a.removed()], wire=False, buffered=False)
                await pub.publish([b.stored(1, 3)], wire=False, buffered=False)
                await pub.publish([c.stored(0, 1)], wire=False)  # lost on the way only
                await pub.publish([c.stored(1, 2)], wire=False)
                p = await _wait_seq(gw, await pub.publish([d.stored()]))
                ev = p["events"]
                assert (ev["lost"], ev["replayed"] >= 2, ev["resets"]) == (2, True, 0)
                assert (ev["gaps_kept"], ev["kept_blocks"]) == (1, 5)
                # A (kept: its removal was lost) and B's first block (its next two were
                # lost), C (replayed) and D (live)
                assert p["index_blocks"] == 4 + 1 + 2 + 2
                assert ev["unconfirmed_blocks"] == 5  # A and B's root, not C
                assert await _matched(gw, c.tokens) == 2
                assert await _matched(gw, d.tokens) == 2
                assert await _matched(gw, a.tokens) == 4
                assert await _matched(gw, b.tokens) == 1
        finally:
            await pub.close()

    run(main())


# -- an engine that goes away and comes back ---------------------------------------------------
def test_an_instance_marked_down_loses_its_entries_and_resyncs_when_it_is_back() -> None:
    async def main() -> None:
        pub = ScriptedPublisher()
        a, b, c = Chain(1, 4), Chain(2, 3), Chain(3, 2)
        try:
            async with engines("p0", "d0") as (p0, d0), \
                    _gateway_with(pub, p0, d0, replay_timeout_s=10, **FAST_HEALTH) as gw:
                await pub.publish([a.stored()])
                p = await _wait_seq(gw, await pub.publish([b.stored()]))
                assert p["index_blocks"] == 7 and p["routable"]
                resets = p["events"]["resets"]
                p0.healthy = False

                async def down() -> dict[str, Any] | None:
                    p = await _p0(gw)
                    return None if p["healthy"] else p
                p = await until(down, what="p0 marked down")
                assert not p["routable"] and p["index_blocks"] == 0
                assert p["events"]["resets"] == resets + 1
                assert not await gw.ready()
                # while it is away: A goes, C comes (the buffer keeps all of it)
                await pub.publish([a.removed()])
                seq = await pub.publish([c.stored()])
                replays = len(pub.replay_requests)
                pub.replay_gate = gate = asyncio.Event()
                p0.healthy = True

                async def replaying() -> dict[str, Any] | None:
                    p = await _p0(gw)
                    return p if p["healthy"] and len(pub.replay_requests) > replays else None
                p = await until(replaying, what="p0 healthy, its replay asked for")
                # healthy, but not routable before its events are replayed from the start
                assert pub.replay_requests[replays:] == [0]
                assert not p["registered"] and not p["routable"]
                await asyncio.sleep(0.2)  # health checks pass meanwhile
                p = await _p0(gw)
                assert not p["registered"] and not p["routable"] and p["index_blocks"] == 0
                gate.set()

                async def back() -> dict[str, Any] | None:
                    p = await _p0(gw)
                    return p if p["routable"] else None
                p = await until(back, what="p0 routable again")
                # B and C, not A
                assert p["events"]["last_seq"] == seq
                assert p["index_blocks"] == 5
                assert p["events"]["resets"] == resets + 2
                assert await _matched(gw, b.tokens) == 3
                assert await _matched(gw, c.tokens) == 2
                assert await _matched(gw, a.tokens) == 0
        finally:
            await pub.close()

    run(main())


def test_an_instance_that_leaves_the_endpoint_list_and_rejoins_is_resynced() -> None:
    async def main() -> None:
        pub = ScriptedPublisher()
        a, b = Chain(1, 4), Chain(2, 3)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            async with engines("p0", "p1", "d0") as (p0, p1, d0):
                with_p0 = {"prefill": [p0.endpoint(**pub.endpoint_fields()), p1.endpoint()],
                           "decode": [d0.endpoint()]}
                without = {**with_p0, "prefill": [p1.endpoint()]}

                def write(doc: dict[str, Any]) -> None:
                    tmp = path + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump(doc, f)
                    os.replace(tmp, path)
                write(with_p0)
                cfg = {"name": MODEL, "block_size": BLOCK, "endpoints_file": path}
                async with running_gateway([cfg], discovery_poll_s=0.05,
                                           replay_timeout_s=10) as gw:
                    p = await _wait_seq(gw, await pub.publish([a.stored()]))
                    assert p["index_blocks"] == 4 and p["listed"]
                    write(without)

                    async def gone() -> dict[str, Any] | None:
                        p = await _p0(gw)
                        return None if p["listed"] else p
                    p = await until(gone, what="p0 left")
                    assert p["index_blocks"] == 0 and not p["routable"]
                    seq = await pub.publish([b.stored()])  # while it is not followed
                    await asyncio.sleep(0.1)
                    assert (await _p0(gw))["index_blocks"] == 0
                    replays = len(pub.replay_requests)
                    pub.replay_gate = gate = asyncio.Event()
                    write(with_p0)

                    async def replaying() -> bool:
                        return len(pub.replay_requests) > replays
                    await until(replaying, what="p0's replay asked for")
                    await asyncio.sleep(0.1)
                    p = await _p0(gw)
                    assert p["listed"] and not p["registered"] and not p["routable"]
                    gate.set()

                    async def rejoined() -> dict[str, Any] | None:
                        p = await _p0(gw)
                        return p if p["routable"] else None
                    p = await until(rejoined, what="p0 back")
                    assert p["events"]["last_seq"] == seq and p["index_blocks"] == 7
        finally:
            await pub.close()
            os.unlink(path)

    run(main())


# -- an engine restart -------------------------------------------------------------------------
def test_a_publisher_restart_drops_the_old_entries_and_follows_the_new_stream() -> None:
    async def main() -> None:
        pub = ScriptedPublisher()
        a, b = Chain(1, 4), Chain(2, 3)
        new: ScriptedPublisher | None = None
        try:
            async with engines("p0", "d0") as (p0, d0), \
                    _gateway_with(pub, p0, d0) as gw:
                await pub.publish([a.stored()])
                for _ in range(8):  # the old stream got well past where the new one starts
                    await pub.publish([])
                p = await _wait_seq(gw, pub.seq - 1)
                assert p["index_blocks"] == 4
                endpoint, replay = pub.endpoint, pub.replay_endpoint
                await pub.close()
                new = ScriptedPublisher(bind=(endpoint, replay))
                await new.publish([b.stored()])

                async def restarted() -> dict[str, Any] | None:
                    assert new is not None
                    await new.publish([])
                    await asyncio.sleep(0.05)
                    p = await _p0(gw)
                    return p if p["events"]["restarts"] and p["index_blocks"] == 3 else None
                # the new engine's B is in; A went with the old one
                p = await until(restarted, what="the restart seen, B replayed")
                assert p["events"]["restarts"] == 1 and p["events"]["lost"] == 0
                assert await _matched(gw, a.tokens) == 0
                assert await _matched(gw, b.tokens) == 3
        finally:
            await pub.close()
            if new is not None:
                await new.close()

    run(main())
