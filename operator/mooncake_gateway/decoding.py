"""The decode half of a request: sent to the chosen decode instance (with the prefill's
transfer fields spliced in), and once more to the least loaded other one of its group
when it fails before answering; its answer relayed whole, or its stream relayed chunk by
chunk with TTFT and TBT observed. A stream that fails midway ends with an SSE error.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import aiohttp
from aiohttp import web
from mooncake_conductor.engine import Decision
from mooncake_conductor.state import RequestInfo

from .enginecalls import (
    UPSTREAM_RETRY_STATUSES,
    EngineCalls,
    UpstreamError,
    relayed_error,
    splice_json,
)
from .errors import ApiError, error_body
from .front import PlainJson
from .instances import Instance
from .runtime import ModelRuntime
from .validate import Parsed

#: what answers a completion request: aiohttp's response, or the fast front end's own
Answer = web.StreamResponse | PlainJson
DECODE_ATTEMPTS = 2
SSE_DONE = b"data: [DONE]"


class DecodeRunner:
    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls

    async def run(self, request: web.Request | None, rt: ModelRuntime, req: RequestInfo,
                  decision: Decision, p: Parsed, fields: dict[str, Any],
                  record: dict[str, Any], headers: dict[str, str], arrived: float,
                  explain: bool, group: int | None,
                  attempts: int = DECODE_ATTEMPTS) -> Answer:
        """The decode half, with the handshake's ``fields`` spliced into the body."""
        body = splice_json(p.raw, fields) if fields else p.raw
        path = "/v1/chat/completions" if p.chat else "/v1/completions"
        iid = decision.decode.decode
        tried: set[int] = set()
        last = "no decode instance"
        for attempt in range(attempts):
            if attempt:
                rt.m.retries_decode.inc()
                iid = self._replace_decode(rt, tried, group)
            if iid is None:
                break
            inst = rt.decode[iid]
            tried.add(iid)
            record["decode"] = inst.name
            rt.load.decode_started(inst, req)
            try:
                resp: Answer
                if p.stream:
                    assert request is not None  # the fast front end hands streams to aiohttp
                    # the TBT the decode selector predicted, for its own choice only
                    predicted = (decision.decode.predicted_tbt_s
                                 if iid == decision.decode.decode else 0.0)
                    resp = await self._stream(request, rt, inst, path, body, headers, arrived,
                                              predicted)
                else:
                    resp = await self._unary(rt, inst, path, body, headers, record, explain,
                                             plain=request is None)
                    rt.slo.served(time.perf_counter() - arrived, None)
                record["outcome"] = "ok"
                return resp
            except UpstreamError as exc:
                last = f"{inst.name}: {exc}"
                record["attempts"].append({"decode": inst.name, "error": str(exc)})
                if not str(exc).startswith("HTTP"):
                    rt.members.mark_health(inst, False)
            finally:
                rt.load.decode_done(inst, req)
        raise ApiError(502, f"decode failed ({last})", code="upstream_failed")

    def _replace_decode(self, rt: ModelRuntime, excluded: set[int],
                        group: int | None) -> int | None:
        """The least loaded other decode instance (of ``group`` after a prefill: the KV
        came from an engine of that revision)."""
        live = [d for d in rt.cluster.decode if d.up and d.iid not in excluded
                and (group is None or d.group == group)]
        if not live:
            return None
        return min(live, key=lambda d: (d.batch + d.waiting, d.iid)).iid

    async def _unary(self, rt: ModelRuntime, inst: Instance, path: str, body: bytes,
                     headers: dict[str, str], record: dict[str, Any],
                     explain: bool, plain: bool = False) -> web.Response | PlainJson:
        """A non-streamed decode; ``plain``: for the fast front end (:class:`PlainJson`
        when the answer needs no header of its own)."""
        status, resp, raw = await self.calls.post(inst, path, body, parse=explain)
        if status in UPSTREAM_RETRY_STATUSES:
            raise UpstreamError(f"HTTP {status}")
        if status != 200:
            raise relayed_error(status, resp)
        if not explain:  # the decode answer goes back as it came
            if plain and not headers:
                return PlainJson(raw)
            return web.Response(body=raw, content_type="application/json", headers=headers)
        if not isinstance(resp, dict):
            raise UpstreamError("answer is not a JSON object")
        resp["conductor"] = record
        return web.Response(text=json.dumps(resp), content_type="application/json",
                            headers=headers)

    async def _stream(self, request: web.Request, rt: ModelRuntime, inst: Instance, path: str,
                      body: bytes, headers: dict[str, str],
                      arrived: float, predicted_tbt_s: float = 0.0) -> web.StreamResponse:
        upstream = await self.calls.open_stream(inst.endpoint.url + path, body)
        async with upstream:
            if upstream.status in UPSTREAM_RETRY_STATUSES:
                raise UpstreamError(f"HTTP {upstream.status}")
            if upstream.status != 200:
                raw = await upstream.read()
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = None
                raise relayed_error(upstream.status, parsed)
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
            await resp.prepare(request)
            first: float | None = None
            last_at = 0.0
            intervals: list[float] = []
            done = False
            buf = b""
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                    buf += chunk
                    events, buf = _split_events(buf)
                    now = time.perf_counter()
                    for ev in events:
                        if ev.startswith(SSE_DONE):
                            done = True
                        elif first is None:
                            if _has_token(ev):
                                first = last_at = now
                                rt.m.ttft.observe(now - arrived)
                        else:
                            rt.m.tbt.observe(now - last_at)
                            intervals.append(now - last_at)
                            last_at = now
                if not done:
                    raise UpstreamError("stream ended early")
            except ConnectionResetError:  # the client went away; closing upstream aborts it
                return resp
            except (aiohttp.ClientError, TimeoutError, UpstreamError) as exc:
                err = error_body(502, f"decode failed mid-stream on {inst.name}: "
                                 f"{type(exc).__name__}", code="upstream_failed")
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    await resp.write_eof()
                rt.members.mark_health(inst, False)
                rt.slo.missed()
                return resp
            await resp.write_eof()
            if first is not None:
                rt.slo.served(first - arrived, intervals)
                rt.load.decode_observed(predicted_tbt_s, intervals)
            return resp



def _split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    parts = buf.split(b"\n\n")
    return [p.strip() for p in parts[:-1] if p.strip()], parts[-1]


def _has_token(event: bytes) -> bool:
    """Whether an SSE event carries generated text (not the chat role-only first chunk)."""
    if not event.startswith(b"data:"):
        return False
    try:
        obj = json.loads(event[5:])
    except ValueError:
        return False
    for c in obj.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False
