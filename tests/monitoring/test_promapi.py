"""The Prometheus API client against a fake Prometheus (canned 2.x JSON) and a real one."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from mooncake_monitoring import promapi

from tests.needs import missing

NOW = 1_700_000_000.0

#: What Prometheus 2.x answers for a query it cannot parse (HTTP 400).
PARSE_ERROR = "invalid parameter \"query\": 1:4: parse error: unexpected end of input"

ALERTS = [{
    "labels": {"alertname": "MooncakeTTFTHigh", "severity": "warning", "model": "llama"},
    "annotations": {"summary": "p99 time to first token above 2 s"},
    "state": "firing", "activeAt": "2023-11-14T22:13:20.123456789Z", "value": "2.5e+00",
}]

TARGETS = [{
    "discoveredLabels": {"__address__": "127.0.0.1:8000", "__metrics_path__": "/metrics",
                         "__scheme__": "http", "job": "gateway"},
    "labels": {"instance": "127.0.0.1:8000", "job": "gateway"},
    "scrapePool": "gateway", "scrapeUrl": "http://127.0.0.1:8000/metrics",
    "globalUrl": "http://gw:8000/metrics", "lastError": "",
    "lastScrape": "2023-11-14T22:13:19.5Z", "lastScrapeDuration": 0.0021,
    "health": "up", "scrapeInterval": "5s", "scrapeTimeout": "5s",
}]


def vector(*samples: tuple[dict[str, str], str], at: float = NOW) -> dict[str, Any]:
    return {"resultType": "vector",
            "result": [{"metric": m, "value": [at, v]} for m, v in samples]}


def matrix(*series: tuple[dict[str, str], list[str]], start: float = NOW,
           step: float = 5.0) -> dict[str, Any]:
    return {"resultType": "matrix", "result": [
        {"metric": m, "values": [[start + i * step, v] for i, v in enumerate(vs)]}
        for m, vs in series]}


class FakePrometheus:
    """A ThreadingHTTPServer on 127.0.0.1 answering like Prometheus 2.x.

    ``instant`` maps an expression to the ``data`` of /api/v1/query; ``range`` is a function
    from expression to the ``data`` of /api/v1/query_range (empty matrix by default);
    ``errors`` maps an expression to (HTTP status, errorType, error). Every request lands in
    ``requests`` as (path, {param: value}).
    """

    def __init__(self) -> None:
        self.instant: dict[str, dict[str, Any]] = {}
        self.range: Callable[[str], dict[str, Any]] = lambda expr: matrix()
        self.errors: dict[str, tuple[int, str, str]] = {}
        self.is_ready = True
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakePrometheus:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, params: dict[str, str]) -> tuple[int, Any]:
        self.requests.append((path, params))
        expr = params.get("query", "")
        if path in ("/api/v1/query", "/api/v1/query_range") and expr in self.errors:
            status, kind, text = self.errors[expr]
            return status, {"status": "error", "errorType": kind, "error": text}
        if path == "/api/v1/query":
            return 200, self._ok(self.instant.get(expr, vector()))
        if path == "/api/v1/query_range":
            if not all(k in params for k in ("start", "end", "step")):
                return 400, {"status": "error", "errorType": "bad_data",
                             "error": "invalid parameter \"start\": cannot parse \"\""}
            return 200, self._ok(self.range(expr))
        if path == "/api/v1/alerts":
            return 200, self._ok({"alerts": ALERTS})
        if path == "/api/v1/targets":
            return 200, self._ok({"activeTargets": TARGETS, "droppedTargets": []})
        if path == "/-/ready":
            ok = self.is_ready
            return (200, "Prometheus Server is Ready.\n") if ok else (503, "Service Unavailable")
        return 404, "404 page not found\n"

    @staticmethod
    def _ok(data: dict[str, Any]) -> dict[str, Any]:
        return {"status": "success", "data": data}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                params = {k: v[-1] for k, v in parse_qs(url.query).items()}
                status, body = fake.answer(url.path, params)
                is_json = not isinstance(body, str)
                raw = (json.dumps(body) if is_json else body).encode()
                self.send_response(status)
                self.send_header("Content-Type",
                                 "application/json" if is_json else "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def fake() -> Iterator[FakePrometheus]:
    with FakePrometheus() as prom:
        yield prom


def test_query_instant_vector_keeps_labels_and_parses_values(fake: FakePrometheus) -> None:
    fake.instant["up"] = vector(({"job": "gateway", "instance": "a"}, "1"),
                                ({"job": "operator", "instance": "b"}, "0"))
    samples = promapi.query(fake.url, "up", at=NOW)
    assert samples == [promapi.Sample({"job": "gateway", "instance": "a"}, 1.0),
                       promapi.Sample({"job": "operator", "instance": "b"}, 0.0)]
    path, params = fake.requests[-1]
    assert path == "/api/v1/query"
    assert params["query"] == "up"
    assert float(params["time"]) == NOW


def test_query_without_time_lets_prometheus_choose(fake: FakePrometheus) -> None:
    promapi.query(fake.url, "up")
    assert "time" not in fake.requests[-1][1]


def test_query_scalar_is_one_unlabelled_sample(fake: FakePrometheus) -> None:
    fake.instant["scalar(1.5)"] = {"resultType": "scalar", "result": [NOW, "1.5"]}
    assert promapi.query(fake.url, "scalar(1.5)") == [promapi.Sample({}, 1.5)]


def test_query_empty_vector(fake: FakePrometheus) -> None:
    assert promapi.query(fake.url, "absent_metric") == []


def test_query_range_parses_times_and_special_values(fake: FakePrometheus) -> None:
    fake.range = lambda expr: matrix(({"model": "llama"}, ["0.25", "NaN", "+Inf", "-Inf"]),
                                     ({"model": "qwen"}, ["3"]))
    series = promapi.query_range(fake.url, "ttft", NOW, NOW + 15, 5)
    assert [s.labels for s in series] == [{"model": "llama"}, {"model": "qwen"}]
    assert series[0].times == [NOW, NOW + 5, NOW + 10, NOW + 15]
    first, nan, inf, neg = series[0].values
    assert first == 0.25 and math.isnan(nan) and inf == math.inf and neg == -math.inf
    assert series[1].values == [3.0]
    _, params = fake.requests[-1]
    assert (float(params["start"]), float(params["end"]), float(params["step"])) == \
        (NOW, NOW + 15, 5.0)


def test_error_carries_prometheus_message(fake: FakePrometheus) -> None:
    fake.errors["sum("] = (400, "bad_data", PARSE_ERROR)
    with pytest.raises(promapi.PromError) as info:
        promapi.query(fake.url, "sum(")
    assert PARSE_ERROR in str(info.value)
    assert "400" in str(info.value)
    assert info.value.error_type == "bad_data"
    assert info.value.status == 400
    with pytest.raises(promapi.PromError, match="parse error: unexpected end of input"):
        promapi.query_range(fake.url, "sum(", NOW, NOW + 60, 5)


def test_execution_error_status_422(fake: FakePrometheus) -> None:
    text = "query processing would load too many samples into memory in query execution"
    fake.errors["huge"] = (422, "execution", text)
    with pytest.raises(promapi.PromError, match="execution: query processing") as info:
        promapi.query(fake.url, "huge")
    assert info.value.status == 422


def test_non_json_error_names_the_status(fake: FakePrometheus) -> None:
    with pytest.raises(promapi.PromError, match="404"):
        promapi.alerts(fake.url + "/nowhere")


def test_connection_refused_is_a_prom_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(promapi.PromError, match="cannot reach Prometheus"):
        promapi.query(f"http://127.0.0.1:{port}", "up", timeout=2)


def test_alerts_and_targets(fake: FakePrometheus) -> None:
    assert promapi.alerts(fake.url) == ALERTS
    got = promapi.targets(fake.url + "/")  # a trailing slash is tolerated
    assert [(t["labels"]["job"], t["health"]) for t in got] == [("gateway", "up")]


def test_ready(fake: FakePrometheus) -> None:
    assert promapi.ready(fake.url) is True
    fake.is_ready = False
    assert promapi.ready(fake.url) is False
    fake.server.shutdown()
    fake.server.server_close()
    assert promapi.ready(fake.url) is False


# --- a real Prometheus ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def real_prometheus(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        missing("prometheus", "prometheus not found: apt-get install prometheus")
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    url = f"http://127.0.0.1:{_free_port()}"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address={url.removeprefix('http://')}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not promapi.ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("prometheus did not become ready:\n"
                            + (tmp_path / "prometheus.log").read_text()[-2000:])
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_real_prometheus(real_prometheus: str) -> None:
    url = real_prometheus
    assert promapi.query(url, "vector(1)") == [promapi.Sample({}, 1.0)]
    assert promapi.query(url, "scalar(vector(3))") == [promapi.Sample({}, 3.0)]
    end = time.time()
    series = promapi.query_range(url, "vector(2)", end - 60, end, 15)
    assert len(series) == 1
    assert series[0].labels == {}
    assert series[0].values == [2.0] * 5
    assert series[0].times[-1] - series[0].times[0] == pytest.approx(60)
    assert promapi.targets(url) == []
    assert promapi.alerts(url) == []
    with pytest.raises(promapi.PromError, match="parse error") as info:
        promapi.query(url, "sum(")
    assert info.value.error_type == "bad_data"
