"""Replicas of the gateway share their in-flight load.

Every replica serves (the gateway Service spreads clients over them) and is fed by the
engines' KV events, so their indexes agree; but each knows only the requests it placed.
Two replicas that each admit up to the TTFT SLO's worth of queued prefill fill the
engines twice over. So each replica answers ``/conductor/load`` (an admin route) with its
own load per model and instance, asks every peer for theirs each ``interval_s``, and
folds what they report into its cluster state as foreign load (the rule and what is
shared: ``mooncake_conductor/peerload.py``).

Peers are fixed URLs (``peers.urls``) or, in Kubernetes, the running pods that match
``peers.pod_selector`` other than this one (the chart selects the operator's pods, whose
sidecar the gateway is). A peer that does not answer keeps its last report until it is
``stale_s`` old; then it counts nothing. A pod that is gone is forgotten at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from mooncake_conductor.peerload import LoadReport
from mooncake_kube.client import KubeClient
from mooncake_kube.listwatch import ListWatch

from .auth import KeyRing
from .discovery import kube_client, running_pod_host
from .runtime import ModelRuntime
from .settings import PeerSettings

log = logging.getLogger(__name__)

#: seconds a stopping pod watch may take to end
JOIN_WAIT_S = 2.0


def peer_urls(pods: Mapping[str, dict[str, Any]], cfg: PeerSettings) -> dict[str, str]:
    """``namespace/name`` -> base URL of every running pod in ``pods`` with an IP, other
    than ``cfg.pod_name`` and pods being deleted."""
    out: dict[str, str] = {}
    for key, pod in pods.items():
        host = running_pod_host(pod)
        if host is not None and (pod.get("metadata") or {}).get("name") != cfg.pod_name:
            out[key] = f"http://{host}:{cfg.port}"
    return out


class PeerSync:
    """Asks the peers for their load and hands each report to the model it is about."""

    def __init__(self, cfg: PeerSettings, runtimes: Callable[[], Mapping[str, ModelRuntime]],
                 keys: KeyRing, kube: KubeClient | None = None) -> None:
        self.cfg = cfg
        self._runtimes = runtimes
        self._keys = keys
        self._kube = kube
        #: peer name -> base URL
        self.peers: dict[str, str] = {u: u for u in cfg.urls}
        self._watch: ListWatch | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failing: set[str] = set()

    # -- the route the peers call ------------------------------------------------------------
    async def load(self, _r: web.Request) -> web.Response:
        """``/conductor/load``: this replica's own in-flight load, per model."""
        return web.json_response({"models": {name: rt.load.load_report().to_json()
                                             for name, rt in self._runtimes().items()}})

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if not self.cfg.enabled:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        if self.cfg.pod_selector is not None:
            loop = asyncio.get_running_loop()
            if self._kube is None:
                self._kube = await asyncio.to_thread(kube_client)

            def report(pods: dict[str, dict[str, Any]]) -> None:
                urls = peer_urls(pods, self.cfg)
                loop.call_soon_threadsafe(self._set_peers, urls)

            self._watch = ListWatch(self._kube, f"/api/v1/namespaces/{self.cfg.namespace}/pods",
                                    self.cfg.pod_selector, self.cfg.watch_timeout_s, report,
                                    "gateway-peers")
            self._watch.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="peer-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._watch is not None:
            self._watch.stop()
            await asyncio.to_thread(self._watch.join, JOIN_WAIT_S)
        if self._session is not None:
            await self._session.close()

    def _set_peers(self, urls: dict[str, str]) -> None:
        for gone in set(self.peers) - set(urls):
            log.info("gateway peer %s is gone", gone)
            for rt in self._runtimes().values():
                rt.load.peer_gone(gone)
        for new in set(urls) - set(self.peers):
            log.info("gateway peer %s at %s", new, urls[new])
        self.peers = urls

    # -- asking ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except Exception:  # one bad round must not end the sharing for good
                log.exception("sharing load with the gateway peers failed; trying again")
            await asyncio.sleep(self.cfg.interval_s)

    async def sync_once(self) -> None:
        """Ask every peer once, then refold every model's foreign load (stale reports
        stop counting here even when no peer answers)."""
        peers = dict(self.peers)
        answers = await asyncio.gather(*(self._ask(p, url) for p, url in peers.items()))
        runtimes = self._runtimes()
        for peer, doc in zip(peers, answers, strict=True):
            if doc is None or peer not in self.peers:
                continue
            for name, raw in doc.items():
                rt = runtimes.get(name)
                if rt is None:
                    continue
                try:
                    rt.peers.update(peer, LoadReport.from_json(raw), rt.now())
                except ValueError as exc:
                    self._failed(peer, f"bad report for model {name}: {exc}")
        for rt in runtimes.values():
            rt.load.apply_peers()

    async def _ask(self, peer: str, url: str) -> dict[str, Any] | None:
        assert self._session is not None
        headers: dict[str, str] = {}
        if self._keys.enabled:
            if self._keys.peer_key is None:
                self._failed(peer, "no admin key to ask with (peers need gateway.auth's "
                             "admin Secret)")
                return None
            headers["Authorization"] = f"Bearer {self._keys.peer_key}"
        try:
            async with self._session.get(url + "/conductor/load", headers=headers) as resp:
                if resp.status != 200:
                    self._failed(peer, f"HTTP {resp.status}")
                    return None
                doc = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._failed(peer, type(exc).__name__)
            return None
        models = doc.get("models") if isinstance(doc, dict) else None
        if not isinstance(models, dict):
            self._failed(peer, "the answer has no 'models' object")
            return None
        if peer in self._failing:
            self._failing.discard(peer)
            log.info("gateway peer %s answers again", peer)
        return models

    def _failed(self, peer: str, why: str) -> None:
        if peer not in self._failing:  # once per outage, not every interval
            self._failing.add(peer)
            log.warning("gateway peer %s: %s; its last report counts until %.1f s old",
                        peer, why, self.cfg.stale_s)
