"""JSON on the request path: orjson when it can, the standard library otherwise.

orjson parses a request body several times faster than ``json`` (a 100k-token id prompt:
milliseconds), but it refuses a few things ``json`` takes (``NaN``/``Infinity``, numbers
beyond a float's range, UTF-16 text, lone surrogates); for those the gateway falls back to
``json``, so what it accepts and the messages of its 400 answers stay as they were. One
difference remains: an integer beyond 64 bits may come back as a float. Every field the
gateway checks (token ids, ``max_tokens``, ``n``) is refused either way (a float is not an
integer; such an integer is out of range), and the body goes upstream as the client sent it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes | str) -> Any:
    """Parse JSON text; raises ``ValueError`` (``json``'s message) when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON (no spaces after separators)."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # e.g. an integer beyond 64 bits
        return json.dumps(obj, separators=(",", ":")).encode()
