"""Gateway replicas share their in-flight load (``mooncake_gateway/peers.py``): each
counts the others' queued prefills and running sequences as foreign load, reports only
its own, asks with the admin key, and stops counting a peer that stops answering."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web
from mooncake_gateway.auth import KeyRing
from mooncake_gateway.peers import PeerSync, peer_urls
from mooncake_gateway.settings import AuthSettings, PeerSettings

from .gateway_fixtures import HOST, free_port
from .scripted import MODEL, engines, model, prompt_ids, running_gateway, serving, until

PROMPT_TOKENS = 16_384  # ~2 s of predicted prefill each: outlasts the reads below
FAST_SYNC = {"interval_s": 0.05, "timeout_s": 0.5, "stale_s": 0.6}
ADMIN_KEY = "admin-key-for-peers"


def _prefill(st: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in st["prefill"] if p["name"] == name)


def test_each_replica_counts_the_others_prefills_and_never_echoes_them() -> None:
    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0):
            pa, pb = free_port(), free_port()
            m = [model([p0, p1], [d0])]
            async with running_gateway(m, port=pa, peers={
                    "urls": [f"http://{HOST}:{pb}"], **FAST_SYNC}) as a, \
                    running_gateway(m, port=pb, peers={
                        "urls": [f"http://{HOST}:{pa}"], **FAST_SYNC}) as b:
                p0.hold, p1.hold, d0.hold = asyncio.Event(), asyncio.Event(), asyncio.Event()
                sent = [asyncio.create_task(a.post("/v1/completions", {
                    "model": MODEL, "prompt": prompt_ids(PROMPT_TOKENS, first=i + 1),
                    "max_tokens": 3})) for i in range(3)]

                async def arrived() -> bool:
                    return len(p0.calls) + len(p1.calls) == 3
                await until(arrived)
                busy = "p0" if len(p0.calls) >= len(p1.calls) else "p1"

                async def b_counts_them() -> dict[str, Any] | None:
                    st = await b.state()
                    return st if _prefill(st, busy)["foreign_work_s"] > 0 else None
                st_b = await until(b_counts_them, what="B counts A's prefills")
                st_a = await a.state()
                # B's wait there is A's queue (read a moment apart: both drain)
                own_a = _prefill(st_a, busy)["predicted_wait_s"]
                wait_b = _prefill(st_b, busy)["predicted_wait_s"]
                assert own_a > 1.0 and abs(wait_b - own_a) < 0.5 * own_a
                assert _prefill(st_b, busy)["queued"] == 0  # none of B's own
                assert st_b["decode"][0]["foreign_batch"] == 0  # none decoding yet
                assert st_b["peers"][f"http://{HOST}:{pa}"]["fresh"] is True
                # A hears B's empty report: it adds nothing, and B never passes A's on
                assert all(p["foreign_work_s"] == 0 for p in st_a["prefill"])
                assert (await b.get("/conductor/load"))["models"][MODEL]["prefill"] == {}
                mine = (await a.get("/conductor/load"))["models"][MODEL]["prefill"]
                assert sum(v["requests"] for v in mine.values()) == 3

                for e in (p0, p1, d0):
                    assert e.hold is not None
                    e.hold.set()
                assert [r[0] for r in await asyncio.gather(*sent)] == [200] * 3

                async def b_clear() -> bool:
                    st = await b.state()
                    return all(p["foreign_work_s"] == 0 for p in st["prefill"])
                await until(b_clear, what="A's load leaves B's view once answered")
    asyncio.run(main())


class ScriptedPeer:
    """A stand-in replica: answers ``/conductor/load`` with :attr:`doc` or
    :attr:`status`, and records the Authorization headers it got."""

    def __init__(self) -> None:
        self.doc: Any = {"models": {MODEL: {
            "prefill": {"p0": {"work_s": 4.0, "requests": 2}},
            "decode": {"d0": {"batch": 3, "context_tokens": 3000, "reserved_tokens": 30}}}}}
        self.status = 200
        self.auth: list[str | None] = []

    async def load(self, request: web.Request) -> web.Response:
        self.auth.append(request.headers.get("Authorization"))
        if self.status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.status)
        return web.json_response(self.doc)


@contextlib.asynccontextmanager
async def scripted_peer() -> AsyncIterator[tuple[ScriptedPeer, str]]:
    peer = ScriptedPeer()
    app = web.Application()
    app.router.add_get("/conductor/load", peer.load)
    async with serving(app) as url:
        yield peer, url


def test_a_peer_that_stops_answering_stops_counting_and_bad_reports_are_ignored(
        tmp_path: Path) -> None:
    admins = tmp_path / "admins"
    admins.mkdir()
    (admins / "ops").write_text(ADMIN_KEY)
    auth = {"admin_keys_dir": str(admins)}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    async def main() -> None:
        async with engines("p0", "p1", "d0") as (p0, p1, d0), scripted_peer() as (peer, url), \
                running_gateway([model([p0, p1], [d0])], auth=auth,
                                peers={"urls": [url], **FAST_SYNC}) as gw:
            async def state() -> list[dict[str, Any]]:
                async with gw.session.get(gw.url + "/conductor/state", headers=admin) as r:
                    assert r.status == 200
                    return list((await r.json())["models"])

            async def counted() -> dict[str, Any] | None:
                st = (await state())[0]
                return st if _prefill(st, "p0")["foreign_work_s"] == 4.0 else None
            st = await until(counted, what="the peer's report is counted")
            assert _prefill(st, "p0")["predicted_wait_s"] >= 4.0 - 0.1
            assert _prefill(st, "p1")["foreign_work_s"] == 0
            assert st["decode"][0]["foreign_batch"] == 3
            assert st["decode"][0]["context_tokens"] == 3000
            assert set(peer.auth) == {f"Bearer {ADMIN_KEY}"}  # asked with the admin key
            # the load route is an admin route like the rest of /conductor/
            async with gw.session.get(gw.url + "/conductor/load") as r:
                assert r.status == 401

            # a malformed report is not applied: the last good one stays until stale
            peer.doc = {"models": {MODEL: {"prefill": {"p0": {"work_s": -5, "requests": 1}}}}}
            await asyncio.sleep(0.2)
            assert _prefill((await state())[0], "p0")["foreign_work_s"] == 4.0

            peer.status = 503

            async def dropped() -> bool:
                st = (await state())[0]
                return (_prefill(st, "p0")["foreign_work_s"] == 0
                        and st["decode"][0]["batch"] == 0)
            await until(dropped, what="a silent peer's load drops when stale")
            assert (await state())[0]["peers"][url]["fresh"] is False
    asyncio.run(main())


def _pod(name: str, ip: str | None, phase: str = "Running",
         deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ops"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip}}


def test_peers_in_kubernetes_are_the_other_running_pods_of_the_selector() -> None:
    cfg = PeerSettings(pod_selector="app=op", namespace="ops", port=8080, pod_name="op-a")
    pods = {f"ops/{p['metadata']['name']}": p for p in (
        _pod("op-a", "10.0.0.1"),  # this pod
        _pod("op-b", "10.0.0.2"),
        _pod("op-c", "fd00::3"),
        _pod("op-d", None, phase="Pending"),
        _pod("op-e", "10.0.0.5", deleting=True),
        _pod("op-f", "10.0.0.6", phase="Succeeded"))}
    assert peer_urls(pods, cfg) == {"ops/op-b": "http://10.0.0.2:8080",
                                    "ops/op-c": "http://[fd00::3]:8080"}


def test_a_failing_round_does_not_end_the_sharing() -> None:
    async def main() -> None:
        sync = PeerSync(PeerSettings(urls=["http://127.0.0.1:1"], interval_s=0.01),
                        lambda: {}, KeyRing(AuthSettings()))
        rounds: list[int] = []
        again = asyncio.Event()

        async def flaky() -> None:
            rounds.append(1)
            if len(rounds) == 1:
                raise RuntimeError("one bad round")
            again.set()
        sync.sync_once = flaky  # type: ignore[method-assign]
        task = asyncio.create_task(sync._run())
        try:
            await asyncio.wait_for(again.wait(), timeout=5)
        finally:
            task.cancel()
        assert len(rounds) >= 2
    asyncio.run(main())
