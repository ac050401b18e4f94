"""Schemathesis against the gateway's own OpenAPI document: every operation it describes,
called with data generated from its schema (valid, then invalid), never answers 5xx, and
every 4xx is OpenAI-shaped. The gateway runs in front of fast workers (``cluster``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from .conftest import Cluster

SERVER_ERROR = 500
TIMEOUT_S = 20
#: examples per operation and generation mode (12 operations, 2 modes)
EXAMPLES = 25


def _operations(cluster: Cluster) -> list[Any]:
    schema = schemathesis.openapi.from_dict(cluster.gateway.get("/openapi.json"))
    return [r.ok() for r in schema.get_all_operations()]  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_no_operation_answers_5xx(cluster: Cluster, mode: GenerationMode) -> None:
    base = f"http://127.0.0.1:{cluster.gateway.port}"
    operations = _operations(cluster)
    assert len(operations) >= 10  # the document describes every route
    seen: dict[str, set[int]] = {}
    expected = set()
    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        if mode is GenerationMode.NEGATIVE and not (len(op.query) or len(op.body)):
            continue  # nothing to make invalid (GET /health and the like)
        expected.add(label)

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def call(case: Any) -> None:
            label = f"{case.method.upper()} {case.path}"
            resp = case.call(base_url=base, timeout=TIMEOUT_S)
            seen.setdefault(label, set()).add(resp.status_code)
            assert resp.status_code < SERVER_ERROR, (label, case.body, resp.text[:300])
            if resp.status_code >= 400 and resp.headers.get("Content-Type", "").startswith(
                    "application/json"):
                err = json.loads(resp.text)["error"]
                assert set(err) == {"message", "type", "param", "code"}, (label, err)

        call()
    assert set(seen) == expected
    assert {"POST /v1/completions", "POST /v1/chat/completions",
            "GET /conductor/decisions"} <= expected
