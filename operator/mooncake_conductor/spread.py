"""How spread out the prompts' prefill times are, and what that does to the price of work.

Rule (:attr:`ServiceSpread.factor`): with ``m1`` and ``m2`` the weighted means of the
cold prefill time ``t`` of each new request and of ``t**2``, the squared coefficient of
variation is ``cv2 = m2 / m1**2 - 1`` and the factor is ``min(1, (1 + cv2) / 2)``. The
conductor multiplies its price of a GPU second (``kappa``) by it.

Source: the Allen-Cunneen approximation for multi-server queues (M/G/c): the mean wait
is the M/M/c wait times ``(1 + cv2) / 2`` for Poisson arrivals. A second of work delays
the requests behind it less when service times are regular (``cv2 < 1``): the queue it
adds clears in step. ``kappa`` (busy share of the pool plus requests waiting per
instance) prices a second as if service were exponential (factor 1).

Why capped at 1: ``kappa`` counts the requests already waiting, so a heavy-tailed
workload's longer queues are in it already. Uncapped, the factor (2.7 on the Mooncake
conversation trace, ``cv2`` 4.4) priced work so dear that the conductor's charged mean
TTFT there rose 9%; capped, it changes nothing on heavy tails and makes work cheaper on
regular ones (0.81-0.83 on the tool-and-agent and long-prompt shapes, ``cv2`` about
0.6), where chunked-pipeline groups then pay off more often
(``docs/conductor.md``, items 6 and 7).
"""

from __future__ import annotations


class ServiceSpread:
    """Weighted moments of each new request's cold prefill time over about ``window``
    requests; :attr:`factor` is 1 (exponential service, the price unchanged) until
    ``min_samples`` have been seen: one prompt has no spread to measure. The caller
    observes each request once (the conductor: when :class:`..arrivals.ArrivalRate`
    counts it as a new arrival)."""

    def __init__(self, window: int, min_samples: int = 1) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be at least 1")
        self.window = window
        self.min_samples = min_samples
        self._count = 0
        self._m1 = 0.0
        self._m2 = 0.0

    def observe(self, seconds: float) -> None:
        """A new request would take ``seconds`` on one idle instance with nothing cached."""
        self._count += 1
        # the plain mean until the window fills, then the weighted one
        w = 1.0 / min(self._count, self.window)
        self._m1 += (seconds - self._m1) * w
        self._m2 += (seconds * seconds - self._m2) * w

    @property
    def cv2(self) -> float:
        """The squared coefficient of variation (0 before any positive time)."""
        if self._m1 <= 0.0:
            return 0.0
        return max(0.0, self._m2 / (self._m1 * self._m1) - 1.0)

    @property
    def factor(self) -> float:
        """``min(1, (1 + cv2) / 2)``; 1 before ``min_samples`` requests or any positive
        time."""
        if self._count < self.min_samples or self._m1 <= 0.0:
            return 1.0
        return min(1.0, (1.0 + self.cv2) / 2.0)
