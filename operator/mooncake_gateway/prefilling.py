"""The prefill half of a disaggregated request: on the chosen instance (or where late
binding hands its turn), then on the next best of the decode instance's group while
attempts are left. A prefill that fails before the client got anything is retried; an
engine marked down while a call waits is given up at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from mooncake_conductor.engine import Decision
from mooncake_conductor.state import RequestInfo

from .enginecalls import (
    UPSTREAM_RETRY_STATUSES,
    EngineCalls,
    UpstreamError,
    relayed_error,
    splice_json,
)
from .errors import ApiError
from .handshake import Handshake, Transfer
from .instances import Instance
from .runtime import ModelRuntime
from .settings import GatewaySettings
from .validate import Parsed

T = TypeVar("T")


class PrefillRunner:
    def __init__(self, settings: GatewaySettings, calls: EngineCalls) -> None:
        self.settings = settings
        self.calls = calls

    async def tracked(self, rt: ModelRuntime, req: RequestInfo, decision: Decision,
                      p: Parsed, record: dict[str, Any], group: int, hs: Handshake,
                      transfer: Transfer, attempts: int | None = None) -> Transfer:
        """:meth:`run`, with the request counted in flight on its decode instance
        meanwhile (a draining decode pod is not retired under it), and the policy told
        when it ends."""
        dec = decision.decode.decode
        assert dec is not None  # a disaggregated decision names its decode instance
        chosen = rt.decode[dec]
        chosen.inflight += 1
        try:
            return await self.run(rt, req, decision, p, record, group, hs, transfer,
                                  attempts)
        finally:
            chosen.inflight -= 1
            rt.conductor.prefilled(req, decision)

    async def run(self, rt: ModelRuntime, req: RequestInfo, decision: Decision,
                  p: Parsed, record: dict[str, Any], group: int, hs: Handshake,
                  transfer: Transfer, attempts: int | None = None) -> Transfer:
        """Prefill on the chosen instance, then on the next best of ``group`` (the decode
        instance's) while attempts are left; the transfer as the instance that served it
        made it."""
        overrides: dict[str, Any] = {"stream": False, "stream_options": None, "max_tokens": 1}
        if p.chat:
            overrides["max_completion_tokens"] = None
        path = "/v1/chat/completions" if p.chat else "/v1/completions"
        tried: set[int] = set()
        pl = decision.placement
        last = "no prefill instance"
        for attempt in range(attempts or self.settings.prefill_attempts):
            if attempt:
                rt.m.retries_prefill.inc()
                pl = self._replace_prefill(rt, req, tried, group)
                if pl is None:
                    break
            assert pl.prefill is not None
            inst = rt.prefill[pl.prefill]
            tried.add(inst.iid)
            prio = pl.priority if pl.priority is not None else req.arrival
            # only the decision's own placement is in the policy's books, so only it can
            # move (a retry's stays where it is sent)
            rt.queues.prefill_started(inst, req, pl.prefill_s + pl.transfer_s, prio,
                               pl if attempt == 0 else None)
            started = time.perf_counter()
            status = 0
            try:
                # late binding: its turn, maybe elsewhere
                queued = await rt.queues.prefill_turn(req)
                if queued.iid != inst.iid and queued.placement is not None:
                    record["attempts"].append({"prefill": inst.name, "stolen_by":
                                               rt.prefill[queued.iid].name})
                    inst, pl = rt.prefill[queued.iid], queued.placement
                    tried.add(inst.iid)
                    decision.placement = pl  # the policy's books moved with it
                    record["prefill"] = inst.name
                    started = time.perf_counter()  # predicted from the move on
                transfer = transfer.with_prefill(inst.endpoint)
                body = splice_json(p.raw, {**overrides, **hs.prefill_fields(transfer)})
                status, resp = await unless_down(inst, self.calls.post_json(inst, path, body))
            except UpstreamError as exc:
                last = f"{inst.name}: {exc}"
                record["attempts"].append({"prefill": inst.name, "error": str(exc)})
                rt.members.mark_health(inst, False)
                continue
            finally:
                ok = status == 200
                answered_s = (time.perf_counter() - started) / rt.time_scale
                rt.queues.prefill_done(inst, req, answered_s, pl.ttft_s if ok else None)
            # modelled seconds from placement to answer, and what the placement predicted
            # for it: the pair the calibration learns from
            record["attempts"].append({"prefill": inst.name, "status": status,
                                       "answered_s": answered_s, "predicted_s": pl.ttft_s})
            if status == 200 and isinstance(resp, dict):
                usage = resp.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                prompt = usage.get("prompt_tokens") or req.input_tokens
                rt.counters.engine_cached_tokens += int(cached)
                rt.counters.engine_prompt_tokens += int(prompt)
                rt.m.engine_cached_tokens.inc(int(cached))
                rt.m.engine_prompt_tokens.inc(int(prompt))
                record["engine_cached_tokens"] = int(cached)
                return transfer
            if status in UPSTREAM_RETRY_STATUSES:
                last = f"{inst.name}: HTTP {status}"
                continue
            raise relayed_error(status, resp)
        raise ApiError(502, f"prefill failed on every instance tried ({last})",
                       code="upstream_failed")

    def _replace_prefill(self, rt: ModelRuntime, req: RequestInfo, excluded: set[int],
                         group: int) -> Any:
        """The next-best placement with the ``excluded`` instances and those of other
        groups than ``group`` out of consideration."""
        states = [s for s in rt.cluster.prefill
                  if s.up and (s.iid in excluded or s.group != group)]
        for s in states:
            s.up = False
        try:
            d = rt.conductor.policy.choose(req, rt.cluster, rt.now())
        finally:
            for s in states:
                s.up = True
        return d if d.prefill is not None else None


async def unless_down(inst: Instance, call: Awaitable[T]) -> T:
    """``call``'s result, unless ``inst`` is marked down first (failed health checks):
    then the call is abandoned with :class:`UpstreamError`, so a prefill on an engine
    that accepts connections and never answers is retried elsewhere within the health
    checks' few seconds, not after ``request_timeout_s``. Nothing has reached the
    client at that point, so the retry is safe."""
    task = asyncio.ensure_future(call)
    down = inst.went_down()
    try:
        await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, UpstreamError):
        await task
    raise UpstreamError("marked down while the call waited")
