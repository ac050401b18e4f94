"""Holding: a request refused only for decode room waits for room instead of a 429.

Rule: when a request's prefill placement is within the TTFT SLO but no decode instance
can take it within the TBT SLO (``tbt-slo``), it is held until ``arrival + TTFT SLO -
predicted prefill and transfer`` (the latest start that can still meet the TTFT SLO)
and offered again, oldest first, whenever a decode instance finishes a request. It is
rejected (``tbt-slo``) only when that deadline passes. Placement at the retry is made
afresh, and admission then counts the time already waited.

Why: the paper's overload rule (§4, "reject at once") turns a request away the moment
the decode pool is full, even when room frees a second later and the request could
still meet both SLOs. Under a decode pool that saturates in bursts, requests rejected
at a peak leave decode capacity idle in the trough after it. Holding trades TTFT for
SLO attainment: a held request is served late but within its TTFT SLO, which the
paper's goodput (requests within both SLOs) counts, and a 429 does not.

The simulator and the gateway hold: the gateway keeps the HTTP request and decides
again each time one of its decode requests ends.

By default it is on for ``conductor`` with a decode selector that counts the requests
already placed (``tbt-lookahead``): several held requests released at once by one
finished decode must not all see the same free room. With the paper's ``tbt-slo``
selector they do, and pile onto one instance (measured: TBT p99 past 7 s against a
100 ms SLO), so holding stays off there unless asked for.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HoldingConfig(BaseModel):
    """Holding requests refused for decode room (see :mod:`mooncake_conductor.holding`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = Field(
        None, description="hold requests refused only for decode room until room frees or "
        "the TTFT SLO can no longer be met (None: the policy's default, on for conductor "
        "with the tbt-lookahead decode selector; needs admission)")


def hold_deadline(arrival: float, ttft_slo_s: float, prefill_s: float,
                  transfer_s: float) -> float:
    """The latest time a held request's prefill can start and still meet the TTFT SLO,
    by its placement's predicted prefill and transfer."""
    return arrival + ttft_slo_s - prefill_s - transfer_s
