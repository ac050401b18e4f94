"""Which engine pods are crash-looping: crashes counted over a sliding window.

Rule: a pod is crash-looping while its containers crashed at least ``threshold`` times in
the last ``window_s`` seconds (settings ``crash_loop_restarts`` and
``crash_loop_window_s``). The window follows the kubelet's restart back-off, which forgets a
container's crashes once it has run 10 minutes without one; so a pod that healed clears
``Degraded`` by itself, and a single crash never sets it. (Counting lifetime restarts, as
before, kept a cluster that had three isolated, healed crashes ``Degraded`` until the pod
was deleted.)

Kubernetes keeps only a container's lifetime ``restartCount`` and its last termination, so
the operator dates each crash itself: when the count grows, the new crashes are dated at the
last termination's ``finishedAt`` (or now, without one). A pod first seen with restarts
(an operator that just started) has its latest crash dated and up to ``threshold - 1``
older ones assumed just as recent: a pod crashing when the operator starts is reported at
once, and clears a window after its last crash like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .observe import PodView


@dataclass(slots=True)
class _Pod:
    restarts: int
    crashes: list[float] = field(default_factory=list)  # crash times, oldest first
    seen: float = 0.0


class CrashHistory:
    """Crash times of every engine pod the reconciles see (one per operator process)."""

    def __init__(self, window_s: float, threshold: int) -> None:
        self.window_s = window_s
        self.threshold = threshold
        self._pods: dict[str, _Pod] = {}

    def observe(self, pods: Iterable[PodView], now: float) -> dict[str, int]:
        """Record ``pods`` as seen ``now``; each one's crashes within the window, by uid."""
        out: dict[str, int] = {}
        for p in pods:
            h = self._pods.get(p.uid)
            if h is None:
                h = self._pods[p.uid] = _Pod(restarts=0)
                new = min(p.restarts, self.threshold)
            else:
                new = max(0, p.restarts - h.restarts)
            if new:
                at = p.last_crash_at if p.last_crash_at is not None else now
                h.crashes.extend([min(at, now)] * new)
            h.restarts = max(h.restarts, p.restarts)
            h.seen = now
            h.crashes = [t for t in h.crashes if t > now - self.window_s]
            out[p.uid] = len(h.crashes)
        for uid in [u for u, h in self._pods.items() if h.seen < now - self.window_s]:
            del self._pods[uid]  # gone (or another cluster's, not looked at for a window)
        return out
