"""The pod-annotation contract between the Conductor controller and the pod agent.

The operator's Conductor controller asks a prefill pod to hold replicas of hot prefixes by
patching :data:`REPLICA_ANNOTATION` on it; Kubernetes projects pod annotations into a file
through the downward API (``fieldRef: metadata.annotations``), one ``key="value"`` line
per annotation, the value quoted like Go's ``strconv.Quote``; the worker's pod agent reads
that file.

Annotation value: a JSON array of entries, each naming one prefix::

    [{"prefix": "sys-prompt-7", "tokens": [101, 102, ...]},
     {"prefix": "doc-42", "keys": [12345678901234567890, ...]}]

- ``prefix``: an id (string or int) naming the replica.
- ``tokens``: the prefix's token ids; the agent derives the block keys itself (full
  blocks only).
- ``keys``: the prefix's block keys (``mooncake_conductor.blockkeys``); usable only when
  the blocks are in the Mooncake Store (their payload carries the tokens).

Writers use :func:`format_replicas`, readers :func:`parse_annotations` then
:func:`parse_replicas`; both sides are pinned by golden vectors in the tests.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from .conventions import ANNOTATION_REPLICAS

log = logging.getLogger(__name__)

#: Pod annotation naming the prefixes a pod should hold.
REPLICA_ANNOTATION = ANNOTATION_REPLICAS

_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "\\": "\\", '"': '"', "'": "'"}


def go_unquote(s: str) -> str:
    """Inverse of Go's ``strconv.Quote`` for a double-quoted string."""
    if len(s) < 2 or s[0] != '"' or s[-1] != '"':
        raise ValueError(f"not a quoted string: {s[:40]!r}")
    body = s[1:-1]
    out: list[str] = []
    raw = bytearray()  # \xNN escapes are bytes of UTF-8
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            if raw:
                out.append(raw.decode("utf-8", "replace"))
                raw.clear()
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("dangling backslash")
        e = body[i + 1]
        if e == "x":
            raw.append(int(body[i + 2 : i + 4], 16))
            i += 4
            continue
        if raw:
            out.append(raw.decode("utf-8", "replace"))
            raw.clear()
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            i += 2
        elif e == "u":
            out.append(chr(int(body[i + 2 : i + 6], 16)))
            i += 6
        elif e == "U":
            out.append(chr(int(body[i + 2 : i + 10], 16)))
            i += 10
        elif e in "01234567":
            raw.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            raise ValueError(f"unknown escape \\{e}")
    if raw:
        out.append(raw.decode("utf-8", "replace"))
    return "".join(out)


def parse_annotations(text: str) -> dict[str, str]:
    """Parse a downward-API annotations file (bad lines are skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or "=" not in line:
            continue
        key, _, value = line.partition("=")
        try:
            out[key.strip()] = go_unquote(value.strip())
        except (ValueError, IndexError):
            log.warning("skipping malformed annotation line %r", line[:80])
    return out


@dataclass
class ReplicaSpec:
    prefix: str
    tokens: list[int] | None = None
    keys: list[int] | None = None


def parse_replicas(value: str) -> list[ReplicaSpec]:
    """Parse the annotation value; raises ValueError on a malformed document."""
    data = json.loads(value)
    if not isinstance(data, list):
        raise ValueError("replica annotation must be a JSON array")
    out: list[ReplicaSpec] = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("prefix"), str | int):
            raise ValueError("each replica needs a 'prefix' id")
        tokens, keys = item.get("tokens"), item.get("keys")
        for name, v in (("tokens", tokens), ("keys", keys)):
            if v is not None and not (
                isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            and t >= 0 for t in v)
            ):
                raise ValueError(f"'{name}' must be a list of non-negative ints")
        if tokens is None and keys is None:
            raise ValueError("each replica needs 'tokens' or 'keys'")
        out.append(ReplicaSpec(str(item["prefix"]), tokens, keys))
    return out


def format_replicas(specs: list[ReplicaSpec]) -> str:
    """The annotation value for ``specs`` (compact JSON, entries in the given order);
    :func:`parse_replicas` reads it back to equal specs."""
    out: list[dict[str, object]] = []
    for s in specs:
        item: dict[str, object] = {"prefix": s.prefix}
        if s.tokens is not None:
            item["tokens"] = s.tokens
        if s.keys is not None:
            item["keys"] = s.keys
        out.append(item)
    return json.dumps(out, separators=(",", ":"))


def go_quote(s: str) -> str:
    """Go's ``strconv.Quote`` for the characters annotation values hold (what the kubelet
    writes into a downward-API file): ``\\``, ``\"`` and control characters escaped,
    printable Unicode kept as is."""
    out = ['"']
    for ch in s:
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif ch in _QUOTE_ESCAPES:
            out.append(_QUOTE_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        elif not ch.isprintable():
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_QUOTE_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                  "\t": "\\t", "\v": "\\v"}
