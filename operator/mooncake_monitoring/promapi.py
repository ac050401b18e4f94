"""A tiny client for Prometheus' HTTP API (``/api/v1``), on urllib only.

Every call is one blocking GET. Results are normalised to plain dataclasses: an instant query
gives :class:`Sample` s (a scalar result is one sample with no labels), a range query gives
:class:`Series`. Sample values arrive as strings in Prometheus' JSON ("1.5", "NaN", "+Inf");
they are parsed to floats. Any failure — an HTTP error status, a JSON body with
``"status": "error"``, a connection error, an unparseable body — raises :class:`PromError`
carrying Prometheus' own message when it sent one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode
from urllib.request import Request, urlopen

__all__ = ["PromError", "Sample", "Series", "alerts", "query", "query_range", "ready", "targets"]


class PromError(Exception):
    """A Prometheus API call failed; ``error_type`` is Prometheus' errorType when it sent one."""

    def __init__(self, message: str, *, error_type: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.status = status


@dataclass(frozen=True)
class Sample:
    """One element of an instant vector (or a scalar, with no labels)."""

    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    """One element of a range vector: parallel lists of unix times and values."""

    labels: dict[str, str]
    times: list[float]
    values: list[float]


def query(url: str, expr: str, at: float | None = None, timeout: float = 10) -> list[Sample]:
    """Evaluate ``expr`` at ``at`` (unix seconds; Prometheus' now when None)."""
    params: dict[str, str] = {"query": expr}
    if at is not None:
        params["time"] = repr(float(at))
    data = _data(url, "/api/v1/query", params, timeout)
    kind, result = data.get("resultType"), data.get("result", [])
    if kind == "vector":
        return [Sample(dict(r.get("metric", {})), _float(r["value"][1])) for r in result]
    if kind == "scalar":
        return [Sample({}, _float(result[1]))]
    raise PromError(f"query {expr!r} gave a {kind} result; only vector and scalar are handled")


def query_range(
    url: str, expr: str, start: float, end: float, step: float, timeout: float = 30
) -> list[Series]:
    """Evaluate ``expr`` every ``step`` seconds from ``start`` to ``end`` (unix seconds)."""
    params = {"query": expr, "start": repr(float(start)), "end": repr(float(end)),
              "step": repr(float(step))}
    data = _data(url, "/api/v1/query_range", params, timeout)
    if data.get("resultType") != "matrix":
        raise PromError(f"query_range {expr!r} gave a {data.get('resultType')} result")
    return [
        Series(
            dict(r.get("metric", {})),
            [float(t) for t, _ in r.get("values", [])],
            [_float(v) for _, v in r.get("values", [])],
        )
        for r in data["result"]
    ]


def alerts(url: str, timeout: float = 10) -> list[dict[str, Any]]:
    """The alerts Prometheus currently holds (pending and firing), as Prometheus sends them."""
    return list(_data(url, "/api/v1/alerts", {}, timeout).get("alerts", []))


def targets(url: str, timeout: float = 10) -> list[dict[str, Any]]:
    """The active scrape targets, as Prometheus sends them (``health``, ``labels``, ...)."""
    return list(_data(url, "/api/v1/targets", {}, timeout).get("activeTargets", []))


def ready(url: str, timeout: float = 2) -> bool:
    """True when ``/-/ready`` answers 200; False on any other status or no answer at all."""
    try:
        with urlopen(Request(_join(url, "/-/ready")), timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (HTTPError, URLError, OSError):
        return False


def _join(url: str, path: str, params: dict[str, str] | None = None) -> str:
    full = url.rstrip("/") + path
    return f"{full}?{urlencode(params)}" if params else full


def _data(url: str, path: str, params: dict[str, str], timeout: float) -> dict[str, Any]:
    """GET ``path`` and return the ``data`` member of a successful Prometheus envelope."""
    full = _join(url, path, params)
    request = Request(full, headers={"Accept": "application/json"})
    try:
        with urlopen(request, timeout=timeout) as resp:
            body: bytes = resp.read()
    except HTTPError as e:
        raise _error_from(e) from None
    except (URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise PromError(f"cannot reach Prometheus at {url}: {reason}") from e
    envelope = _json(body, full)
    if envelope.get("status") != "success":
        raise PromError(_message(envelope, "no error text"),
                        error_type=str(envelope.get("errorType", "")))
    data = envelope.get("data")
    if not isinstance(data, dict):
        raise PromError(f"{full}: no 'data' object in the answer")
    return data


def _error_from(e: HTTPError) -> PromError:
    """Prometheus answers errors with a status code and a JSON envelope; keep its text."""
    try:
        envelope = json.loads(e.read())
    except (ValueError, OSError):
        envelope = None
    if not isinstance(envelope, dict):
        return PromError(f"HTTP {e.code} {e.reason} from {e.url}", status=e.code)
    return PromError(f"HTTP {e.code} {_message(envelope, str(e.reason))}",
                     error_type=str(envelope.get("errorType", "")), status=e.code)


def _message(envelope: dict[str, Any], fallback: str) -> str:
    kind, text = envelope.get("errorType"), envelope.get("error") or fallback
    return f"{kind}: {text}" if kind else str(text)


def _json(body: bytes, where: str) -> dict[str, Any]:
    try:
        envelope = json.loads(body)
    except ValueError as e:
        raise PromError(f"{where}: answer is not JSON ({e})") from e
    if not isinstance(envelope, dict):
        raise PromError(f"{where}: answer is not a JSON object")
    return envelope


def _float(value: Any) -> float:
    """Prometheus sends sample values as strings: "1.5", "NaN", "+Inf", "-Inf"."""
    return float(value)
