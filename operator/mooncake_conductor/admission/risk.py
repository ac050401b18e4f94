"""A TTFT margin for the prefill-time prediction error: the work ahead of a request is
a sum of predictions, each off by its own factor.

Rule: a request placed at ``now`` waits for the work ahead of it on its instance (the
remainder of the running prefill, the queued prefills it will not pass) and then runs its
own prefill; call those predicted seconds ``w_i``. Each actually takes ``w_i F_i`` with
``ln F_i ~ N(mu, sigma^2)`` independent (the log-normal error model of
:mod:`..overrun`, whose estimator measures ``mu`` and ``sigma`` online). The sum
``S = sum w_i F_i`` has mean ``M = e^(mu + sigma^2/2) sum w_i`` and variance
``V = e^(2 mu + sigma^2) (e^(sigma^2) - 1) sum w_i^2``. Its ``1 - risk`` quantile is taken
from the log-normal with that mean and variance (the Fenton–Wilkinson approximation):
``M exp(-s^2/2 + z s)``, ``s^2 = ln(1 + V / M^2)``, ``z`` the standard normal quantile of
``1 - risk``. The margin is that quantile minus ``sum w_i``, at least 0 (it only ever
tightens the paper's rule).

Why: under overload, admission on the predicted TTFT lets queues fill up to the SLO, and
a prediction is a median: about half the requests admitted near the SLO then miss it.
The margin is wide for a queue of a few long prefills (their errors do not average out)
and narrow for one of many short ones. All the work in one item gives the widest margin,
``total (e^(mu + z sigma) - 1)`` (for ``z >= sigma``; :func:`widest_growth`), an O(1)
test that passes most requests without walking the queue.

Source: the log-normal error model of the simulator's ``--prediction-error`` and of
:mod:`..overrun`; Fenton, "The sum of log-normal probability distributions in scatter
transmission systems", IRE Trans. Commun. Syst. 8(1), 1960.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from ..state import ClusterState, PrefillState


def z_of(risk: float) -> float:
    """The standard normal quantile of ``1 - risk``."""
    return NormalDist().inv_cdf(1.0 - risk)


def sum_quantile(total: float, squares: float, mu: float, sigma: float, z: float) -> float:
    """The quantile at ``z`` of ``sum w_i F_i`` given ``total = sum w_i`` and ``squares =
    sum w_i^2`` (log-normal with the sum's mean and variance)."""
    if total <= 0.0:
        return 0.0
    mean = math.exp(mu + sigma * sigma / 2.0) * total
    var = math.exp(2.0 * mu + sigma * sigma) * math.expm1(sigma * sigma) * squares
    s2 = math.log1p(var / (mean * mean))
    return mean * math.exp(-s2 / 2.0 + z * math.sqrt(s2))


def widest_growth(mu: float, sigma: float, z: float) -> float:
    """The largest margin per predicted second, over every split of the work: the
    quantile over the total is ``exp(mu + sigma^2/2 - s^2/2 + z s)`` with ``s`` between 0
    (many equal items) and ``sigma`` (one item), largest at ``s = z`` within that range."""
    s = min(max(z, 0.0), sigma)
    return math.expm1(mu + (sigma * sigma - s * s) / 2.0 + z * s)


def ttft_margin(work: list[float], mu: float, sigma: float, z: float) -> float:
    """Seconds to add to a predicted TTFT whose prefill work (ahead and own) is ``work``,
    so that it is exceeded with the chance that ``z`` stands for (never negative)."""
    total = sum(work)
    squares = sum(w * w for w in work)
    return max(0.0, sum_quantile(total, squares, mu, sigma, z) - total)


def instance(cluster: ClusterState, iid: int) -> PrefillState | None:
    """The prefill state of instance ``iid`` (ids are usually list positions)."""
    pool = cluster.prefill
    if iid < len(pool) and pool[iid].iid == iid:
        return pool[iid]
    return next((p for p in pool if p.iid == iid), None)


def work_ahead(inst: PrefillState, now: float, priority: float | None) -> list[float]:
    """Predicted seconds of the prefills a new one with ``priority`` waits for on
    ``inst`` (``None``: all queued, FIFO), the running one's remainder first, then
    the other replicas' prefills there (foreign: their mean each)."""
    work = [max(0.0, inst.busy_until - now)]
    if inst.foreign_requests:
        work += [inst.foreign_work_s / inst.foreign_requests] * inst.foreign_requests
    work += [q.work_s for q in inst.queue if priority is None or q.priority <= priority]
    return work
