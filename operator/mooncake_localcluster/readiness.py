"""A container's readiness from its probe results, read as the kubelet reads them.

Rule (Kubernetes' probe semantics, ``core/v1`` ``Probe``): a container starts not ready;
``successThreshold`` consecutive successes (default 1) make it ready, and
``failureThreshold`` consecutive failures (default 3) make it not ready again. A single
slow answer on a loaded host therefore does not take a pod out of its Services, which a
kubelet would not do either. Each probe waits ``timeoutSeconds`` (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the API's defaults for a probe that does not set them
DEFAULT_SUCCESS_THRESHOLD = 1
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_TIMEOUT_S = 1.0


def probe_timeout_s(probe: dict[str, Any]) -> float:
    """How long one probe waits for its answer."""
    return float(probe.get("timeoutSeconds") or DEFAULT_TIMEOUT_S)


@dataclass
class Readiness:
    """One container's readiness and the run of equal probe results behind it."""

    ready: bool = False
    successes: int = 0
    failures: int = 0

    def record(self, ok: bool, probe: dict[str, Any]) -> bool:
        """Count one probe result; return the readiness it leaves."""
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= int(probe.get("successThreshold") or DEFAULT_SUCCESS_THRESHOLD):
                self.ready = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= int(probe.get("failureThreshold") or DEFAULT_FAILURE_THRESHOLD):
                self.ready = False
        return self.ready

    def started_without_probe(self) -> None:
        """A running container with no readiness probe is ready."""
        self.ready = True

    def restart(self) -> None:
        """A container (re)started or stopped: not ready until probed again."""
        self.ready = False
        self.successes = self.failures = 0
