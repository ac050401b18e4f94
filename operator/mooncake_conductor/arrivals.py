"""What a placement costs the requests that arrive after it: the arrival rate, and the
wait of the arrivals a choice shuts out of the pool.

Rule (:func:`shut_out_wait`): after a choice, every live prefill instance is free again
at some predicted time (0 for an idle one); ``t`` is the earliest. Requests arrive at the
measured rate ``r``; each one that comes before ``t`` finds no instance free and waits
until ``t``: ``r * t**2 / 2`` seconds in all, in the same seconds as a TTFT. A choice
that leaves an instance idle charges nothing; one that takes the last idle instances
for long charges the arrivals that find none.

Why: a chunked-pipeline (CPP) group holds all its members for its whole makespan. On
a large pool the next arrivals go to the instances it left idle; on a small one, or in
a burst, they queue behind it. The conductor's price of a GPU second (``kappa``) is the
pool's load *now*, which is lowest exactly when idle instances let a group form, so it
does not see this. Measured (``docs/conductor.md``, item 7): pricing it cut the
conductor's charged mean TTFT by 1% on (geometric) average over the conversation trace
and three synthetic shapes at 4, 8 and 16 prefill instances, 80% and 110% load, and by
up to 4.1% (the conversation trace on 4 instances); the worst of the 24 settings got
1.5% slower (mean of three seeds each). Charging every arrival for the instance that
frees in its turn (not only the first) gained as much on average but recomputed more:
the token hit ratio of the synthetic conversation fell from 95% to 94% of its ceiling.

A first-order estimate: it ignores the work the arrivals bring (after ``t`` they may
still queue), and counts only the expected number of arrivals, not their spread.

:class:`ArrivalRate`: an exponentially weighted mean of the gaps between arrivals, each
new request counted once (a request scheduled again while held is not a new arrival).
"""

from __future__ import annotations

from collections.abc import Iterable


def shut_out_wait(ends: Iterable[float], rate: float) -> float:
    """Seconds the next arrivals wait, summed, until the first live instance is free:
    ``ends`` says when each one is (seconds from now; 0 or less: idle), requests come at
    ``rate`` per second. 0 without a rate or with an idle instance."""
    if rate <= 0.0:  # ``ends`` is not even read
        return 0.0
    first = min(ends, default=0.0)
    if first <= 0.0:
        return 0.0
    return rate * first * first / 2.0


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

    def observe(self, rid: int, arrival: float) -> bool:
        """Request ``rid`` arrived at ``arrival``; ids grow with arrival order, so one seen
        before (or an older one) is not counted again. Returns whether it was new."""
        if self._last_rid is not None:
            if rid <= self._last_rid:
                return False
            gap = max(0.0, arrival - self._last_at)
            self._gaps += 1
            # the plain mean until the window fills, then the weighted one
            self._gap += (gap - self._gap) / min(self._gaps, self.window)
        self._last_rid, self._last_at = rid, arrival
        return True

    @property
    def settled(self) -> bool:
        """Whether ``window`` gaps have been measured: before that the rate is a mean
        of a few gaps, and two requests a millisecond apart read as a thousand a
        second."""
        return self._gaps >= self.window

    @property
    def per_s(self) -> float:
        """The rate; 0 until two requests have arrived with time between them."""
        return 1.0 / self._gap if self._gap > 0.0 else 0.0
