"""One completion request from its body to its answer: parse and validate, tokens (cached
or asked of an engine), block keys, the Conductor's decision (held while it may wait for
decode room; 429 when refused), then straight to decode when the uncached part is below
the model's ``direct`` threshold, else prefill then decode, or both at once when the
handshake asks for it. Every request is counted by model, endpoint and outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from typing import Any

import aiohttp
from aiohttp import web
from mooncake_conductor.blockkeys import block_keys_array
from mooncake_conductor.engine import Decision
from mooncake_conductor.state import RequestInfo

from . import fastjson
from .auth import KeyLimiter, LimitExceeded, Principal
from .decoding import Answer, DecodeRunner
from .enginecalls import EngineCalls
from .errors import ApiError
from .fleet import Fleet
from .handshake import Handshake, Transfer, handshake
from .metrics import GatewayMetrics, RequestCounter
from .prefilling import PrefillRunner
from .runtime import ModelRuntime
from .settings import GatewaySettings, TokenizerMode
from .tokens import PromptTokenizer, Tokens
from .validate import Parsed, parse_request

EXPLAIN_HEADER = "x-conductor-explain"
DECISION_HEADER = "x-conductor-decision"
MICRO = 1e6
UNKNOWN_MODEL = "unknown"
OUTCOME_BY_STATUS = {400: "bad_request", 404: "not_found", 413: "too_large", 429: "rejected"}


class Dispatcher:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, fleet: Fleet,
                 calls: EngineCalls, limits: KeyLimiter) -> None:
        self.settings = settings
        self.metrics = metrics
        self.request_counter = RequestCounter(metrics)
        self.fleet = fleet
        self.calls = calls
        self.limits = limits
        self.tokenizer = PromptTokenizer(
            settings.tokenize_cache_entries,
            self._remote_tokenize if settings.tokenizer is TokenizerMode.ENGINE else None,
        )
        self.prefills = PrefillRunner(settings, calls)
        self.decodes = DecodeRunner(calls)

    # -- tokenization ----------------------------------------------------------------------
    async def _remote_tokenize(self, body: dict[str, Any]) -> list[int]:
        session = self.calls.session
        assert session is not None
        for rt in self.fleet.models.values():
            for inst in rt.prefill + rt.decode:
                if not inst.routable:
                    continue
                try:
                    async with session.post(inst.endpoint.url + "/tokenize", json=body) as r:
                        data = await r.json(content_type=None)
                        if r.status == 200 and isinstance(data, dict):
                            toks = data.get("tokens")
                            if isinstance(toks, list):
                                return [int(t) for t in toks]
                        if 400 <= r.status < 500:
                            err = data.get("error") if isinstance(data, dict) else None
                            if not isinstance(err, dict):  # not OpenAI's shape
                                err = {}
                            raise ApiError(r.status, str(err.get("message") or "bad prompt"),
                                           err.get("param"), err.get("code"))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue
        raise ApiError(503, "no engine could tokenize the prompt", code="no_tokenizer")

    async def _tokens(self, p: Parsed) -> Tokens:
        if p.prompt_ids is not None:
            return p.prompt_ids
        if p.prompt_text is not None:
            return await self.tokenizer.prompt(p.prompt_text)
        assert p.messages is not None
        return await self.tokenizer.chat(p.messages)

    # -- the OpenAI endpoints --------------------------------------------------------------
    async def answer(self, chat: bool, arrived: float, explain: bool,
                      request: web.Request | None = None, raw: bytes | None = None,
                      principal: Principal | None = None) -> Answer | None:
        """One completion request from ``request`` (aiohttp) or ``raw`` (the fast front end;
        ``None`` is returned for a streamed one), run as ``principal`` (``None``: no keys
        configured)."""
        endpoint = "chat" if chat else "completions"
        model = UNKNOWN_MODEL  # label for requests that name no served model
        outcome: str | None = "error"
        try:
            try:
                if raw is None:
                    assert request is not None
                    raw = await request.read()
                data = fastjson.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"request body is not valid JSON: {exc}") from None
            models = self.fleet.models
            default = next(iter(models)) if len(models) == 1 else None
            p = parse_request(data, chat, default)
            if request is None and p.stream:
                outcome = None  # served (and counted) through aiohttp
                return None
            p.raw = raw
            rt = models.get(p.model)
            if rt is None:
                raise ApiError(404, f"The model `{p.model}` does not exist.", "model",
                               "model_not_found")
            model = p.model
            self.limits.request(principal)
            del data  # the parsed body (a long prompt's list of ints): p holds what is used
            resp = await self._route(request, rt, p, arrived, explain, principal)
            outcome = "ok"
            return resp
        except LimitExceeded as exc:
            outcome = "limited"  # the key's budget, not the cluster: no SLO miss
            self.metrics.key_limited.labels(exc.code or "limit").inc()
            raise
        except ApiError as exc:
            outcome = OUTCOME_BY_STATUS.get(exc.status, "error")
            served = self.fleet.models.get(model)
            if served is not None and (exc.status == 429 or exc.status >= 500):
                served.slo.missed()
            raise
        except web.HTTPException as exc:
            outcome = OUTCOME_BY_STATUS.get(exc.status, "error")
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if outcome is not None:
                self.request_counter.inc(model, endpoint, outcome)

    async def _route(self, request: web.Request | None, rt: ModelRuntime, p: Parsed,
                     arrived: float, explain: bool, principal: Principal | None) -> Answer:
        cfg = rt.cfg
        tokens = await self._tokens(p)
        if len(tokens) == 0:
            raise ApiError(400, "the prompt is empty", "messages" if p.chat else "prompt")
        max_tokens = p.max_tokens or cfg.default_max_tokens
        if len(tokens) + max_tokens > cfg.max_model_len:
            raise ApiError(400, f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) "
                           f"exceeds the context window ({cfg.max_model_len})",
                           "max_tokens", "context_length_exceeded")
        self.limits.tokens(principal, len(tokens) + max_tokens)
        t0 = time.perf_counter()
        key_array = block_keys_array(tokens, cfg.block_size, rt.seed)
        req = rt.request_info(len(tokens), key_array, max_tokens)
        decision, record = self._decide(rt, req, tokens, explain, t0)
        waited = False
        if decision.rejected:
            decision, record, waited = await self._hold(rt, req, tokens, explain, decision,
                                                        record)
        if decision.rejected:
            reason = decision.reject_reason or "rejected"
            self.metrics.rejections.labels(cfg.name, reason).inc()
            rt.m.rejection_seconds["after-hold" if waited else "at-once"].observe(
                time.perf_counter() - arrived)
            raise ApiError(429, f"request rejected by the scheduler ({reason}); retry later",
                           code=reason.replace("-", "_"),
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        try:  # the policy's own count of outstanding requests is released however it ends
            pl = decision.placement
            assert pl.prefill is not None
            # what the chosen instance holds now (pending prefixes and fetches not counted: the
            # engines cannot pull blocks from a peer, so the gateway runs a fetch as a recompute)
            held = rt.index.match(pl.prefill, req.keys)
            reused = req.tokens_of(held)
            # the direct rule: what the chosen decode engine would compute itself
            dec = decision.decode.decode
            dec_held = rt.decode_index.match(dec, req.keys) if dec is not None else 0
            direct = len(tokens) - req.tokens_of(dec_held) < cfg.direct.uncached_tokens_below
            record["direct"] = direct
            record["held_blocks"] = held
            record["decode_held_blocks"] = dec_held
            rt.counters.prompt_tokens += len(tokens)
            if not direct:
                rt.counters.reused_tokens += reused
                rt.counters.prefill_seconds += pl.gpu_seconds
                rt.m.prompt_reused.inc(reused)
                rt.m.prompt_computed.inc(len(tokens) - reused)
            else:
                rt.m.prompt_computed.inc(len(tokens))
            headers = {DECISION_HEADER: json.dumps(_header_view(record), separators=(",", ":"))} \
                if explain else {}
            fields: dict[str, Any] = {}
            group: int | None = None  # the engine group both halves of a P/D request share
            if direct:  # the decode engine prefills itself: in its batch from now on
                rt.conductor.decoding(req, decision)
            else:
                assert dec is not None
                group = rt.cluster.decode[dec].group
                hs = handshake(cfg.handshake)
                transfer = Transfer.new(rt.prefill[pl.prefill].endpoint, cfg.bootstrap_port)
                if hs.concurrent:
                    return await self._both_at_once(
                        request, rt, req, decision, p, record, headers, arrived,
                        explain, group, hs, transfer)
                transfer = await self.prefills.tracked(rt, req, decision, p, record,
                                                       group, hs, transfer)
                fields = hs.decode_fields(transfer)
            return await self.decodes.run(request, rt, req, decision, p, fields, record,
                                      headers, arrived, explain, group)
        finally:
            rt.conductor.finished(req, decision)

    async def _hold(self, rt: ModelRuntime, req: RequestInfo, tokens: Tokens, explain: bool,
                    decision: Decision, record: dict[str, Any]
                    ) -> tuple[Decision, dict[str, Any], bool]:
        """Holding (``mooncake_conductor.holding``): while the Conductor says a request
        refused for decode room may wait, wait for a decode request to end and decide
        again (admission counts the wait); the last decision when the hold ends, and
        whether it waited at all."""
        held = False
        while decision.rejected:
            now = rt.now()
            until = rt.conductor.hold_until(req, decision, now)
            if until is None:
                break
            held = True
            if not await rt.load.wait_decode_room((until - now) * rt.time_scale):
                break  # the deadline passed: the refusal stands
            decision, record = self._decide(rt, req, tokens, explain, time.perf_counter(),
                                            rt.now())
        if held:
            self.metrics.held.labels(rt.cfg.name,
                                     "rejected" if decision.rejected else "placed").inc()
        return decision, record, held

    def _decide(self, rt: ModelRuntime, req: RequestInfo, tokens: Tokens, explain: bool,
                t0: float, now: float | None = None) -> tuple[Decision, dict[str, Any]]:
        """The Conductor's decision for ``req`` at ``now`` (default: its arrival)."""
        if now is None:
            now = req.arrival
        rt.queues.drain(now)
        hot = rt.hot_tokens
        hot.prompt = tokens  # a prefix that gets hot by this request keeps its tokens
        try:
            decision = rt.conductor.schedule(req, rt.cluster, now)
        finally:
            hot.prompt = None
        took = time.perf_counter() - t0
        rt.m.decision.observe(took)
        pl, dc = decision.placement, decision.decode
        record: dict[str, Any] = {
            "id": req.rid, "time": time.time(), "model": rt.cfg.name,
            "policy": rt.cfg.conductor.policy, "prompt_tokens": req.input_tokens,
            "blocks": len(req.keys),
            "prefill": rt.prefill[pl.prefill].name if pl.prefill is not None else None,
            "decode": rt.decode[dc.decode].name if dc.decode is not None else None,
            "local_blocks": pl.local_blocks, "fetch_blocks": pl.fetch_blocks,
            "source": _source_name(rt, pl.source),
            "predicted": {"queue_s": pl.queue_s, "transfer_s": pl.transfer_s,
                          "prefill_s": pl.prefill_s, "ttft_s": pl.ttft_s,
                          "tbt_s": dc.predicted_tbt_s},
            "reject_reason": decision.reject_reason, "decision_us": took * MICRO,
            "attempts": [],
        }
        if explain:
            record["candidates"] = self._candidates(rt, req, now)
        rt.decisions.append(record)
        return decision, record

    def _candidates(self, rt: ModelRuntime, req: RequestInfo, now: float) -> list[dict[str, Any]]:
        """The policy's own best options for ``req``, best first (its ``explain``: for
        ``conductor``, every routable prefill instance priced by the named stages)."""
        rows = rt.conductor.policy.explain(req, rt.cluster, now, self.settings.explain_top)
        return [{**row, "instance": rt.prefill[int(row["instance"])].name} for row in rows]

    # -- prefill and decode at once --------------------------------------------------------
    async def _both_at_once(self, request: web.Request | None, rt: ModelRuntime,
                            req: RequestInfo, decision: Decision, p: Parsed,
                            record: dict[str, Any], headers: dict[str, str], arrived: float,
                            explain: bool, group: int, hs: Handshake,
                            transfer: Transfer) -> Answer:
        """Both halves at once (the prefill engine waits for the decode engine to connect):
        one attempt each, since the decode engine is told which prefill engine to meet. A
        failed prefill cancels the decode and answers with the prefill's error."""
        prefill = asyncio.create_task(self.prefills.tracked(
            rt, req, decision, p, record, group, hs, transfer, attempts=1))
        decode = asyncio.create_task(self.decodes.run(
            request, rt, req, decision, p, hs.decode_fields(transfer), record, headers,
            arrived, explain, group, attempts=1))
        try:
            done, _ = await asyncio.wait({prefill, decode},
                                         return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and prefill.exception() is not None:
                decode.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await decode
                prefill.result()  # raises the prefill's error
            return await decode
        finally:
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def _source_name(rt: ModelRuntime, source: int | None) -> str | None:
    if source is None:
        return None
    if source < len(rt.prefill):
        return rt.prefill[source].name
    return f"instance-{source}"


def _header_view(record: dict[str, Any]) -> dict[str, Any]:
    keep = ("id", "policy", "prefill", "decode", "local_blocks", "fetch_blocks", "predicted",
            "decision_us", "candidates", "direct")
    return {k: finite(record[k]) for k in keep if k in record}


def finite(v: Any) -> Any:
    """``v`` with every non-finite float (JSON has none) as ``None``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite(x) for x in v]
    return v
