"""The ``tbt-slo`` decode rule of :mod:`.decode` compiled (numba): every live row of a
decode pool's board priced at once (:func:`rank_decode`), the cost model's decode step
operation for operation (tests hold the two equal bit for bit).

numba is imported on first use only (:func:`.warmup.warm_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .kernelrows import all_rows, zeros

_decode: Callable[..., tuple[int, int]] | None = None

#: order of the cost model's constants in the array :func:`rank_decode` reads
#: (:meth:`~mooncake_conductor.cost.CostModel.decode_constants`)
DECODE_FIELDS = ("weight_bytes", "kv_bytes_per_token", "hbm", "flops_per_seq",
                 "attn_flops_per_ctx", "peak", "overhead")


def _compile_decode() -> Callable[..., tuple[int, int]]:
    from numba import njit

    @njit(cache=True, nogil=True)
    def rank(
        c: Any, tokens: int, need: int, slo: float, tol: float, eps: float, rows: Any,
        up: Any, context: Any, batch: Any, ahead_n: Any, ahead_tokens: Any, reserved: Any,
        capacity: Any, step: Any, ties: Any,
    ) -> tuple[int, int]:
        kvb = np.int64(c[1])
        best = np.inf
        fastest = -1
        fits = 0  # rows within the SLO with KV room, gathered at the front of ``ties``
        for r in range(rows.shape[0]):
            i = rows[r]
            if not up[i]:
                step[i] = np.inf
                continue
            # CostModel.decode_step_time(batch + 1, context + tokens), operation for
            # operation (batch + 1 >= 1), the requests sent ahead counted in both
            here = context[i] + ahead_tokens[i]
            ctx = here + tokens
            mem = (c[0] + float(ctx * kvb)) / c[2]
            compute = (float(batch[i] + ahead_n[i] + 1) * c[3] + float(ctx) * c[4]) / c[5]
            step[i] = c[6] + (mem if mem >= compute else compute)
            if fastest < 0 or step[i] < step[fastest]:
                fastest = i
            room = capacity[i] <= 0 or here + reserved[i] + need <= capacity[i]
            if step[i] <= slo and room:
                ties[fits] = i
                fits += 1
                if step[i] < best:
                    best = step[i]
        band = best + (abs(best) * tol + eps)
        count = 0
        for j in range(fits):  # keep those inside the tie band, in order
            if step[ties[j]] <= band:
                ties[count] = ties[j]
                count += 1
        return count, fastest

    return rank


def rank_decode(
    consts: npt.NDArray[np.float64], tokens: int, need: int, slo: float, tol: float,
    eps: float, up: npt.NDArray[np.bool_], context: npt.NDArray[np.int64],
    batch: npt.NDArray[np.int64],
    reserved: npt.NDArray[np.int64], capacity: npt.NDArray[np.int64],
    step: npt.NDArray[np.float64], ties: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64] | None = None,
    ahead_n: npt.NDArray[np.int64] | None = None,
    ahead_tokens: npt.NDArray[np.int64] | None = None,
) -> tuple[int, int]:
    """The ``tbt-slo`` decode rule (:mod:`.decode`) over every live instance at once
    (the rows of a :class:`~mooncake_conductor.state.Board` that are ``up``), or over
    the candidate ``rows`` only (ascending): each one's predicted step with a request of
    ``tokens`` context added into ``step``; the rows within the SLO with ``need`` tokens
    of KV room whose step is inside the tie band (``best + (|best| * tol + eps)``) into
    ``ties``, in order. ``ahead_n`` / ``ahead_tokens`` (default none): requests already
    sent to each row that join its batch first, counted in its batch and context.
    Returns the count and the first row of the fastest instance (the answer when none
    fits; -1 when no row is up)."""
    global _decode
    if _decode is None:
        _decode = _compile_decode()
    m = len(up)
    if rows is None:
        rows = all_rows(m)
    if ahead_n is None or ahead_tokens is None:
        ahead_n = ahead_tokens = zeros(m)
    count, fastest = _decode(consts, tokens, need, slo, tol, eps, rows, up, context, batch,
                             ahead_n, ahead_tokens, reserved, capacity, step, ties)
    return int(count), int(fastest)
