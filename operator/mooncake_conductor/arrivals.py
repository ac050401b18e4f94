"""What a placement costs the requests that arrive after it: the arrival rate, and the
wait of the arrivals a choice shuts out of the pool.

Rule (:func:`shut_out_wait`): after a choice, every live prefill instance is free again
at some predicted time (0 for an idle one). Requests arrive at the measured rate ``r``,
the ``j``-th at ``j / r``, and each takes the instance that frees ``j``-th: it waits
``max(0, end_j - j / r)``. The sum over the pool is what the choice makes the next
arrivals wait, in the same seconds as a TTFT. A choice that leaves instances idle
charges nothing; one that takes the last idle ones for long charges the arrivals that
find none.

Why: a chunked-pipeline (CPP) group holds all its members for its whole makespan. On
a large pool the next arrivals go to the instances it left idle; on a small one, or in
a burst, they queue behind it. The conductor's price of a GPU second (``kappa``) is the
pool's load *now*, which is lowest exactly when idle instances let a group form, so it
does not see this. Measured (``benchmarks/scheduling_results.py`` and
``docs/conductor.md``): pricing it cut the conductor's charged mean TTFT by about 1% on
average over the conversation trace and three synthetic shapes at 4, 8 and 16 prefill
instances, and up to 2.4%; no setting got more than 0.5% worse (mean of three seeds).

A first-order estimate: it ignores that the arrivals bring work of their own, and that a
request may arrive with no instance to spare for reasons the choice did not cause (the
same for every option, so it cancels where options are compared).

:class:`ArrivalRate`: an exponentially weighted mean of the gaps between arrivals, each
new request counted once (a request scheduled again while held is not a new arrival).
"""

from __future__ import annotations

from collections.abc import Iterable


def shut_out_wait(ends: Iterable[float], rate: float) -> float:
    """Seconds the next arrivals wait, summed, when requests arrive at ``rate`` per second
    and each takes the instance that frees next; ``ends``: when each live instance is
    free (seconds from now; 0 or less: idle). 0 without a rate."""
    if rate <= 0.0:
        return 0.0
    total = 0.0
    for j, end in enumerate(sorted(ends), start=1):
        late = end - j / rate
        if late > 0.0:
            total += late
    return total


class ArrivalRate:
    """Arrivals per second, an exponentially weighted mean over about ``window`` gaps."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self._gap = 0.0
        self._gaps = 0
        self._last_rid: int | None = None
        self._last_at = 0.0

    def observe(self, rid: int, arrival: float) -> None:
        """Request ``rid`` arrived at ``arrival``; ids grow with arrival order, so one seen
        before (or an older one) is not counted again."""
        if self._last_rid is not None:
            if rid <= self._last_rid:
                return
            gap = max(0.0, arrival - self._last_at)
            self._gaps += 1
            # the plain mean until the window fills, then the weighted one
            self._gap += (gap - self._gap) / min(self._gaps, self.window)
        self._last_rid, self._last_at = rid, arrival

    @property
    def per_s(self) -> float:
        """The rate; 0 until two requests have arrived with time between them."""
        return 1.0 / self._gap if self._gap > 0.0 else 0.0
