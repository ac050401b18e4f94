"""Late binding in the gateway (``prefill_dispatch_depth`` 1, opt-in, with the Conductor's
work stealing on): a prefill engine gets one prefill of ours at a time, the rest wait in
the gateway in queue order, and an instance whose engine answers with nothing left here
takes a prompt held for another (:mod:`mooncake_conductor.stealing`). First the
runtime's own bookkeeping, driven directly; then over real HTTP with scripted engines."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
from mooncake_conductor.policies.base import Placement
from mooncake_conductor.state import RequestInfo
from mooncake_gateway.liveconfig import conductor_config
from mooncake_gateway.metrics import GatewayMetrics
from mooncake_gateway.prefillqueues import QueuedPrefill
from mooncake_gateway.runtime import ModelRuntime
from mooncake_gateway.settings import Endpoint, GatewaySettings, ModelSettings, Role

from .scripted import HOST, MODEL, engines, model, prompt_ids, running_gateway, until

#: long prompts: their predicted prefills (about 2 s each under the paper's cost model)
#: outlast what the tests do between placing and answering, on a loaded host too
LONG = 16_384


def _runtime(stealing: bool = True, prefill: int = 2, **gw: Any) -> ModelRuntime:
    cfg = ModelSettings(name="m", conductor={"stealing": {"enabled": stealing}})
    rt = ModelRuntime(cfg, GatewaySettings(**{"prefill_dispatch_depth": 1, **gw}),
                      GatewayMetrics())
    rt.members.set_endpoints(Role.PREFILL, [Endpoint(url=f"http://{HOST}:{1 + i}")
                                    for i in range(prefill)])
    rt.members.set_endpoints(Role.DECODE, [Endpoint(url=f"http://{HOST}:100")])
    for inst in [*rt.prefill, *rt.decode]:
        rt.members.mark_health(inst, True)
    return rt


def _request(rt: ModelRuntime, first: int, tokens: int = LONG) -> RequestInfo:
    keys = np.arange(first << 20, (first << 20) + tokens // 16, dtype=np.uint64)
    return rt.request_info(tokens, keys, 4)


def _place(rt: ModelRuntime, iid: int, req: RequestInfo, priority: float | None = None
           ) -> Placement:
    """Queue ``req`` on instance ``iid`` as the gateway does after a decision."""
    work = rt.cost.prefill_time(req.input_tokens, 0)
    pl = Placement(prefill=iid, prefill_s=work, priority=req.arrival)
    rt.conductor.policy.on_placed(req, pl, rt.cluster)
    rt.queues.prefill_started(rt.prefill[iid], req, work,
                       req.arrival if priority is None else priority, pl)
    return pl


def _queued(rt: ModelRuntime) -> list[list[int]]:
    return [sorted(q.rid for q in p.queue) for p in rt.cluster.prefill]


async def _behind_a_busy_instance(
    rt: ModelRuntime,
) -> tuple[list[RequestInfo], asyncio.Future[QueuedPrefill]]:
    """r0 sent to p1; r1 sent to p0 and r2 queued behind it: the requests and r2's turn."""
    reqs = [_request(rt, i) for i in (1, 2, 3)]
    for iid, r in zip((1, 0, 0), reqs, strict=True):
        _place(rt, iid, r)
    for r in reqs[:2]:
        await rt.queues.prefill_turn(r)
    return reqs, asyncio.ensure_future(rt.queues.prefill_turn(reqs[2]))


def test_late_binding_is_off_by_default_and_needs_a_stealing_policy() -> None:
    assert not _runtime(prefill_dispatch_depth=0).queues.late_binding  # the default
    assert GatewaySettings().prefill_dispatch_depth == 0
    assert not _runtime(stealing=False).queues.late_binding
    assert _runtime().queues.late_binding


@pytest.mark.parametrize(("depth", "handshake", "steals"), [
    (0, "kv-transfer-params", False), (1, "kv-transfer-params", True), (1, "bootstrap", False),
])
def test_the_conductor_steals_only_where_the_gateway_can_hold_prefills(
        depth: int, handshake: str, steals: bool) -> None:
    """Without late binding (the default depth 0, or a handshake that sends both halves at
    once) the gateway sends every prefill at once and moves none: its Conductor runs with
    work stealing off, so what it reports, and a simulator given its settings, do the same."""
    cfg = ModelSettings(name="m", handshake=handshake, conductor={"policy": "conductor"})
    gw = GatewaySettings(prefill_dispatch_depth=depth)
    assert cfg.conductor.capabilities().stealing  # the policy's own default
    assert conductor_config(cfg, gw).capabilities().stealing is steals
    # what the gateway observes is a whole placement-to-answer time
    assert cfg.conductor.admission_rule.error_of == "prefill"
    assert conductor_config(cfg, gw).admission_rule.error_of == "ttft"
    rt = ModelRuntime(cfg, gw, GatewayMetrics())
    assert (rt.conductor.stealing is not None) is steals
    assert rt.queues.late_binding is steals


def test_held_prefills_go_out_one_at_a_time_in_queue_order() -> None:
    async def main() -> None:
        rt = _runtime(prefill=1)
        assert rt.queues.late_binding
        r1, r2, r3 = (_request(rt, i) for i in (1, 2, 3))
        _place(rt, 0, r1)
        _place(rt, 0, r2, priority=r1.arrival + 2.0)
        _place(rt, 0, r3, priority=r1.arrival + 1.0)  # ahead of r2 in queue order
        assert (await rt.queues.prefill_turn(r1)).sent
        t2 = asyncio.ensure_future(rt.queues.prefill_turn(r2))
        t3 = asyncio.ensure_future(rt.queues.prefill_turn(r3))
        await asyncio.sleep(0.05)
        assert not t2.done() and not t3.done()  # the engine has r1
        assert rt.prefill[0].inflight == 3 and _queued(rt) == [[r1.rid, r2.rid, r3.rid]]
        rt.queues.prefill_done(rt.prefill[0], r1, 1.0, 1.0)
        await asyncio.wait_for(asyncio.shield(t3), 2)
        await asyncio.sleep(0.05)
        assert not t2.done()  # r3 went first: its priority is earlier
        rt.queues.prefill_done(rt.prefill[0], r3, 1.0, 1.0)
        assert (await asyncio.wait_for(t2, 2)).iid == 0
        rt.queues.prefill_done(rt.prefill[0], r2, 1.0, 1.0)
        assert rt.prefill[0].inflight == 0 and _queued(rt) == [[]]
        assert rt.cluster.prefill[0].completed == 3

    asyncio.run(main())


def test_a_prefill_abandoned_while_held_leaves_no_trace_and_lets_the_next_go() -> None:
    async def main() -> None:
        rt = _runtime(prefill=1)
        r1, r2, r3 = (_request(rt, i) for i in (1, 2, 3))
        for r in (r1, r2, r3):
            _place(rt, 0, r)
        await rt.queues.prefill_turn(r1)
        t2 = asyncio.ensure_future(rt.queues.prefill_turn(r2))
        t3 = asyncio.ensure_future(rt.queues.prefill_turn(r3))
        await asyncio.sleep(0.05)
        t2.cancel()  # the client went away while r2 waited here
        with pytest.raises(asyncio.CancelledError):
            await t2
        rt.queues.prefill_done(rt.prefill[0], r2, 0.5)  # the server's finally
        assert _queued(rt) == [[r1.rid, r3.rid]] and rt.prefill[0].inflight == 2
        assert rt.cluster.prefill[0].completed == 0  # never reached the engine
        assert rt.index.match(0, r2.keys, include_pending=True) == 0
        rt.queues.prefill_done(rt.prefill[0], r1, 1.0, 1.0)
        assert (await asyncio.wait_for(t3, 2)).sent

    asyncio.run(main())


@pytest.mark.parametrize("stealing", [True, False], ids=["stealing", "no-stealing"])
def test_an_instance_that_goes_idle_takes_a_prefill_held_for_a_busy_one(
        stealing: bool) -> None:
    """r1 runs on p0 with r2 queued behind it; p1 answers r0 early and has nothing left:
    with stealing it takes r2 (queues, pending prefixes, in-flight counts and the policy's
    books move); without, r2 was sent to p0 at once and stays there."""
    async def main() -> None:
        rt = _runtime(stealing=stealing)
        assert rt.queues.late_binding == stealing
        (r0, r1, r2), t2 = await _behind_a_busy_instance(rt)
        await asyncio.sleep(0.05)
        assert t2.done() != stealing  # held here only with late binding
        assert _queued(rt) == [[r1.rid, r2.rid], [r0.rid]]
        rt.queues.prefill_done(rt.prefill[1], r0, 0.1, 2.0)  # p1 answers well ahead of time
        q = await asyncio.wait_for(t2, 2)
        if stealing:
            assert q.iid == 1 and q.placement is not None and q.placement.prefill == 1
            assert _queued(rt) == [[r1.rid], [r2.rid]]
            assert (rt.prefill[0].inflight, rt.prefill[1].inflight) == (1, 1)
            assert rt.index.match(1, r2.keys, include_pending=True) == len(r2.keys)
            assert rt.index.match(0, r2.keys, include_pending=True) == 0
            assert rt.queues.steals == 1
        else:
            assert q.iid == 0 and _queued(rt) == [[r1.rid, r2.rid], []] and rt.queues.steals == 0
        rt.queues.prefill_done(rt.prefill[q.iid], r2, 1.0, 1.0)  # where it ran now
        rt.queues.prefill_done(rt.prefill[0], r1, 1.0, 1.0)
        assert _queued(rt) == [[], []]
        assert [i.inflight for i in rt.prefill] == [0, 0]

    asyncio.run(main())


def test_nothing_is_stolen_across_engine_revisions() -> None:
    """While a rollout runs two revisions, a prefill stays in its decode instance's group:
    p1 (another revision) goes idle and takes nothing from p0."""
    async def main() -> None:
        rt = _runtime()
        rt.cluster.prefill[1].group = 1
        (r0, r1, r2), t2 = await _behind_a_busy_instance(rt)
        rt.queues.prefill_done(rt.prefill[1], r0, 0.1, 2.0)
        await asyncio.sleep(0.05)
        assert not t2.done() and rt.queues.steals == 0
        assert _queued(rt) == [[r1.rid, r2.rid], []]
        rt.queues.prefill_done(rt.prefill[0], r1, 1.0, 1.0)
        assert (await asyncio.wait_for(t2, 2)).iid == 0

    asyncio.run(main())


def test_depth_zero_sends_at_once_and_a_deeper_one_lets_that_many_go() -> None:
    async def main() -> None:
        for depth, sent_at_once in ((0, 3), (2, 2)):
            rt = _runtime(prefill=1, prefill_dispatch_depth=depth)
            assert rt.queues.late_binding == (depth > 0)
            reqs = [_request(rt, i) for i in (1, 2, 3)]
            for r in reqs:
                _place(rt, 0, r)
            tasks = [asyncio.ensure_future(rt.queues.prefill_turn(r)) for r in reqs]
            await asyncio.sleep(0.05)
            assert sum(t.done() for t in tasks) == sent_at_once, depth
            for t in tasks:
                t.cancel()

    asyncio.run(main())


def test_a_held_prefill_for_an_instance_gone_down_is_sent_to_fail_over() -> None:
    async def main() -> None:
        rt = _runtime(prefill=1, unhealthy_after=1)
        r1, r2 = _request(rt, 1), _request(rt, 2)
        _place(rt, 0, r1)
        _place(rt, 0, r2)
        await rt.queues.prefill_turn(r1)
        t2 = asyncio.ensure_future(rt.queues.prefill_turn(r2))
        await asyncio.sleep(0.05)
        assert not t2.done()
        rt.members.mark_health(rt.prefill[0], False)  # no answer will come from it
        assert (await asyncio.wait_for(t2, 3)).iid == 0  # its call fails, then a retry

    asyncio.run(main())


# -- over HTTP ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stealing", [True, False], ids=["stealing", "no-stealing"])
def test_over_http_the_engine_that_answers_first_serves_the_held_request(
        stealing: bool) -> None:
    """Both prefill engines hold their answers. The third request is placed behind one of
    them: with stealing it waits in the gateway and goes to the other engine as soon as
    that one answers; without, it goes to its engine at once and waits there."""
    async def main() -> None:
        conductor = {"policy": "conductor", "stealing": {"enabled": stealing}}
        async with engines("p0", "p1", "d0") as (p0, p1, d0), running_gateway(
                [model([p0, p1], [d0], conductor=conductor)], prefill_dispatch_depth=1) as gw:
            p0.hold, p1.hold = asyncio.Event(), asyncio.Event()
            by_name = {"p0": p0, "p1": p1}

            def body(i: int) -> dict[str, Any]:
                return {"model": MODEL, "prompt": prompt_ids(LONG, first=i), "max_tokens": 2}

            posts = [asyncio.ensure_future(gw.post("/v1/completions", body(1)))]
            await until(lambda: _true(len(p0.calls) + len(p1.calls) == 1))
            posts.append(asyncio.ensure_future(gw.post("/v1/completions", body(2))))
            await until(lambda: _true(len(p0.calls) + len(p1.calls) == 2))
            assert len(p0.calls) == len(p1.calls) == 1  # the idle one took the second
            posts.append(asyncio.ensure_future(gw.post("/v1/completions", body(3))))

            async def placed() -> list[dict[str, Any]]:
                got: list[dict[str, Any]] = await gw.get(f"/conductor/decisions?model={MODEL}")
                return got if len(got) == 3 else []
            third = (await until(placed))[-1]
            behind = by_name[third["prefill"]]
            other = p1 if behind is p0 else p0
            await asyncio.sleep(0.2)
            assert len(behind.calls) == (1 if stealing else 2)  # held in the gateway
            assert other.hold is not None
            other.hold.set()  # the other engine answers first
            if stealing:
                await until(lambda: _true(len(other.calls) >= 2), what="the steal")
                assert other.calls[1].is_prefill
                assert other.calls[1].body["prompt"] == body(3)["prompt"]
            assert behind.hold is not None
            behind.hold.set()
            for status, _h, raw in await asyncio.gather(*posts):
                assert status == 200, raw
            records = await gw.get(f"/conductor/decisions?model={MODEL}")
            moved = [r for r in records if any("stolen_by" in a for a in r["attempts"])]
            assert len(moved) == (1 if stealing else 0)
            if stealing:
                assert moved[0]["prefill"] == other.name
            metrics = await gw.text("/metrics")
            assert (f'mooncake_gateway_steals_total{{model="{MODEL}"}} '
                    f'{1.0 if stealing else 0.0}') in metrics
            assert all(json.dumps(r) for r in records)

    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value
