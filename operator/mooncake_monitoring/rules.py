"""Alert rules with their clock sped up, for drills that cannot wait an hour.

``compress(rules, factor)`` divides every duration in a rules file by ``factor``: each rule's
``for``, and each range and subquery window in its expression (``[5m]`` → ``[15s]`` at 20x).
Thresholds, label matchers and the logic are untouched, so a drill exercises the shipped
expressions on a shorter clock. Durations round to whole seconds, at least 1 s.
"""

from __future__ import annotations

import copy
import re
from typing import Any

UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_PART = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w|y))+")
#: a range or subquery selector: [5m], [1h:30s], [30m:]
_WINDOW = re.compile(r"\[((?:\d+(?:ms|s|m|h|d|w|y))+)(?::((?:\d+(?:ms|s|m|h|d|w|y))*))?\]")


def seconds(duration: str) -> float:
    """``1h30m`` → 5400.0 (Prometheus duration syntax)."""
    if not _DURATION.fullmatch(duration):
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * UNIT_S[u] for n, u in _PART.findall(duration))


def duration(secs: float) -> str:
    """Whole seconds as the shortest Prometheus duration (at least ``1s``)."""
    s = max(1, round(secs))
    out = ""
    for unit in ("h", "m", "s"):
        n, s = divmod(s, int(UNIT_S[unit]))
        if n:
            out += f"{n}{unit}"
    return out


def compress_expr(expr: str, factor: float) -> str:
    """``expr`` with every range and subquery window divided by ``factor``."""
    def shorter(m: re.Match[str]) -> str:
        rng = duration(seconds(m.group(1)) / factor)
        if m.group(2) is None:
            return f"[{rng}]"
        step = duration(seconds(m.group(2)) / factor) if m.group(2) else ""
        return f"[{rng}:{step}]"

    return _WINDOW.sub(shorter, expr)


def compress(rules: dict[str, Any], factor: float) -> dict[str, Any]:
    """A copy of a rules file (``{"groups": [...]}``) running ``factor`` times faster."""
    if factor <= 0:
        raise ValueError("factor must be positive")
    out = copy.deepcopy(rules)
    for group in out.get("groups") or []:
        if "interval" in group:
            group["interval"] = duration(seconds(group["interval"]) / factor)
        for rule in group.get("rules") or []:
            rule["expr"] = compress_expr(str(rule["expr"]), factor)
            if "for" in rule:
                rule["for"] = duration(seconds(rule["for"]) / factor)
    return out
