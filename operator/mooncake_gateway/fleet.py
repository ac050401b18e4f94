"""The models a gateway serves and the engines behind them: each model's runtime, the
models that ConfigMaps add, change and remove (``catalog.py``), and the background rounds
that check every engine's health and read its metrics, once per engine URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from mooncake_kube.client import KubeClient

from .catalog import Catalog, ConfigMapWatch, Conflict, ModelDocument, resolve
from .enginecalls import EngineCalls
from .enginemetrics import parse_engine_metrics
from .instances import Instance
from .metrics import GatewayMetrics
from .runtime import ModelRuntime
from .settings import GatewaySettings, ModelSettings, Role

log = logging.getLogger(__name__)

Member = tuple[ModelRuntime, Instance]


class Fleet:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, calls: EngineCalls,
                 kube: KubeClient | None = None) -> None:
        """``kube``: the client the ConfigMap watch uses (default: from the in-cluster or
        kube config)."""
        self.settings = settings
        self.metrics = metrics
        self.calls = calls
        self.models: dict[str, ModelRuntime] = {
            m.name: ModelRuntime(m, settings, metrics, on_join=self._joined)
            for m in settings.models
        }
        self.catalog_watch: ConfigMapWatch | None = None
        if settings.kubernetes_models is not None:
            self.catalog_watch = ConfigMapWatch(settings.kubernetes_models, kube)
        self.catalog = Catalog()
        self.documents: list[ModelDocument] | None = None  # the latest seen
        self._documents_dirty = False
        self._reconciler: asyncio.Task[None] | None = None
        self._errors_counted: dict[str, str] = {}  # source -> the error counted last
        self._conflicts_logged: list[Conflict] = []  # conflicts logged already
        self._background: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start every model's endpoint source, the ConfigMap watch and the rounds
        (``calls`` started first: a joining instance is checked at once)."""
        for rt in self.models.values():
            await rt.start()
        if self.catalog_watch is not None:
            await self.catalog_watch.start(self._on_documents)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop()),
                       loop.create_task(self._scrape_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.catalog_watch is not None:
            await self.catalog_watch.stop()
        for task in [self._reconciler, *self._background]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for rt in list(self.models.values()):
            await rt.close()

    # -- models from ConfigMaps -------------------------------------------------------------
    def _on_documents(self, docs: list[ModelDocument]) -> None:
        """The ConfigMap watch's latest list (on the loop): reconciled by one task, which
        picks up whatever came while it worked."""
        self.documents = docs
        self._documents_dirty = True
        if self._reconciler is None or self._reconciler.done():
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile())

    async def _reconcile(self) -> None:
        while self._documents_dirty:
            self._documents_dirty = False
            assert self.catalog_watch is not None and self.documents is not None
            reserved = [n for n, rt in self.models.items() if rt.source is None]
            cat = resolve(self.documents, self.catalog_watch.cfg.key, reserved)
            try:
                await self._apply_catalog(cat)
            except asyncio.CancelledError:
                raise
            except Exception:  # a model that cannot start must not stop the others
                log.exception("applying the model ConfigMaps failed")

    async def _apply_catalog(self, cat: Catalog) -> None:
        self.catalog = cat  # what is invalid or in conflict shows at once
        for name, rt in list(self.models.items()):
            if rt.source is None:
                continue  # the gateway's own settings
            want = cat.served.get(name)
            if want is None:
                log.info("model %s (%s) is no longer served", name, rt.source)
                await rt.close()  # its series go before /v1/models stops listing it
                del self.models[name]
                continue
            source, cfg = want
            if cfg == rt.cfg or rt.can_swap(cfg):
                rt.source = source
                if cfg != rt.cfg:
                    log.info("model %s (%s): new Conductor settings", name, source)
                    rt.reconfigure(cfg)
                continue
            log.info("model %s (%s) changed: a new runtime takes over", name, source)
            new = await self._start_model(cfg, source, cat)
            if new is None:
                del self.models[name]
            else:
                await new.members.wait_settled(self.settings.model_swap_timeout_s)
                self.models[name] = new
            await rt.close(keep=new)
        for name, (source, cfg) in cat.served.items():
            if name not in self.models:
                log.info("model %s (%s) served", name, source)
                new = await self._start_model(cfg, source, cat)
                if new is not None:
                    self.models[name] = new
        for source, err in cat.invalid.items():
            if self._errors_counted.get(source) != err:
                log.warning("model ConfigMap %s is invalid: %s", source, err)
                self.metrics.model_document_errors.labels(source).inc()
        self._errors_counted = dict(cat.invalid)
        for c in set(cat.conflicts) - set(self._conflicts_logged):
            log.warning("model ConfigMap %s names model %s, already served from %s",
                        c.source, c.model, c.winner)
        self._conflicts_logged = list(cat.conflicts)
        served = sum(1 for rt in self.models.values() if rt.source is not None)
        for state, count in (("served", served), ("invalid", len(cat.invalid)),
                             ("conflict", len(cat.conflicts))):
            self.metrics.model_documents.labels(state).set(count)

    async def _start_model(self, cfg: ModelSettings, source: str,
                           cat: Catalog) -> ModelRuntime | None:
        """A runtime for ``cfg`` with its endpoint source started (``None``, and the
        ConfigMap reported invalid, when the source cannot start)."""
        rt = ModelRuntime(cfg, self.settings, self.metrics, source, on_join=self._joined)
        try:
            await rt.start()
        except Exception as exc:
            log.exception("model %s (%s): its endpoint source failed", cfg.name, source)
            await rt.close()
            cat.invalid[source] = f"endpoint source failed: {type(exc).__name__}: {exc}"
            del cat.served[cfg.name]
            return None
        return rt

    def _joined(self, rt: ModelRuntime, inst: Instance) -> None:
        """Check an instance that joined ``rt`` at once (it registers after one pass)."""
        if self.calls.session is None:
            return  # not started: the health loop's first round checks it
        task = asyncio.get_running_loop().create_task(self._check(rt, inst))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- background: health and engine metrics ---------------------------------------------
    def _by_engine(self, healthy_only: bool = False) -> dict[str, list[Member]]:
        """The listed instances by engine URL: an engine that serves as a prefill and a
        decode instance (or for several models) is checked and scraped once a round."""
        out: dict[str, list[Member]] = {}
        for rt in self.models.values():
            for role in Role:
                for inst in rt.members.instances(role):
                    if inst.listed and (inst.healthy or not healthy_only):
                        out.setdefault(inst.endpoint.url, []).append((rt, inst))
        return out

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check_all(url, insts)
                                   for url, insts in self._by_engine().items()))
            await asyncio.sleep(self.settings.health_interval_s)

    async def _check_all(self, url: str, insts: list[Member]) -> None:
        ok = await self.calls.healthy(url)
        for rt, inst in insts:
            rt.members.mark_health(inst, ok)

    async def _check(self, rt: ModelRuntime, inst: Instance) -> None:
        rt.members.mark_health(inst, await self.calls.healthy(inst.endpoint.url))

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(url, insts) for url, insts
                                   in self._by_engine(healthy_only=True).items()))
            await asyncio.sleep(self.settings.metrics_interval_s)

    async def _scrape(self, url: str, insts: list[Member]) -> None:
        """One ``/metrics`` page of the engine at ``url``, applied to its ``insts``."""
        text = await self.calls.metrics_page(url)
        if text is None:
            return
        stats = parse_engine_metrics(text)
        for rt, inst in insts:
            rt.load.apply_stats(inst, stats)
