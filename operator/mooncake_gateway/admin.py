"""The admin API's reads (``/conductor/*`` but the peers' ``/conductor/load``): each
model's state, hot prefixes, index registry and recent decisions, and the catalog of
models from ConfigMaps. Each takes ``?model=`` (default: every model)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .errors import ApiError
from .fleet import Fleet
from .runtime import ModelRuntime
from .settings import GatewaySettings

DECISIONS_DEFAULT_LIMIT = 50


class AdminApi:
    def __init__(self, settings: GatewaySettings, fleet: Fleet) -> None:
        self.settings = settings
        self.fleet = fleet

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/conductor/state", self.conductor_state)
        r.add_get("/conductor/hot-prefixes", self.hot_prefixes)
        r.add_get("/conductor/decisions", self.decisions)
        r.add_get("/conductor/registry", self.registry)
        r.add_get("/conductor/models", self.model_catalog)

    def _model_param(self, request: web.Request) -> list[ModelRuntime]:
        models = self.fleet.models
        name = request.query.get("model")
        if name is None:
            return list(models.values())
        if name not in models:
            raise ApiError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return [models[name]]

    async def conductor_state(self, request: web.Request) -> web.Response:
        models = self._model_param(request)
        return web.json_response({"models": [rt.reports.state() for rt in models]})

    async def hot_prefixes(self, request: web.Request) -> web.Response:
        limit = _int_query(request, "limit", self.settings.hot_prefixes_max)
        with_tokens = _bool_query(request, "tokens")
        out: list[dict[str, Any]] = []
        for rt in self._model_param(request):
            out.extend(rt.reports.hot_prefixes(limit, with_tokens))
        out.sort(key=lambda h: -float(h["rate_per_s"]))
        return web.json_response(out[:limit])

    async def registry(self, request: web.Request) -> web.Response:
        chunk = self.settings.registry_chunk_keys
        return web.json_response(
            {"models": [await rt.reports.registry(chunk) for rt in self._model_param(request)]})

    async def model_catalog(self, _r: web.Request) -> web.Response:
        km = self.settings.kubernetes_models
        fleet = self.fleet
        cat = fleet.catalog
        return web.json_response({
            "kubernetes_models": None if km is None else {
                "namespace": km.namespace, "label_selector": km.label_selector,
                "key": km.key, "listed": fleet.documents is not None,
                "documents": len(fleet.documents or [])},
            "models": [{"model": name, "source": rt.source}
                       for name, rt in sorted(fleet.models.items())],
            "invalid": [{"source": src, "error": err}
                        for src, err in sorted(cat.invalid.items())],
            "conflicts": [{"source": c.source, "model": c.model, "winner": c.winner}
                          for c in cat.conflicts],
        })

    async def decisions(self, request: web.Request) -> web.Response:
        limit = _int_query(request, "limit", DECISIONS_DEFAULT_LIMIT)
        out: list[dict[str, Any]] = []
        for rt in self._model_param(request):
            out.extend(rt.decisions)
        out.sort(key=lambda d: float(d["time"]))
        return web.json_response(out[-limit:] if limit else [])


def _bool_query(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "").lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ApiError(400, f"'{name}' must be 1/true/yes or 0/false/no", name)


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ApiError(400, f"'{name}' must be an integer", name) from None
    if v < 0:
        raise ApiError(400, f"'{name}' must not be negative", name)
    return v
