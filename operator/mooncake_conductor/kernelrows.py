"""Read-only arrays the compiled rankings share: every row of a pool of each size, in
order, and zeros (:mod:`.scoring_kernel`, :mod:`.decode_kernel`)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_ALL_ROWS: dict[int, npt.NDArray[np.int64]] = {}
_ZEROS: dict[int, npt.NDArray[np.int64]] = {}


def all_rows(m: int) -> npt.NDArray[np.int64]:
    """Rows ``0 .. m - 1`` in order (what a full ranking prices); shared, do not write."""
    rows = _ALL_ROWS.get(m)
    if rows is None:
        rows = _ALL_ROWS[m] = np.arange(m, dtype=np.int64)
    return rows


def zeros(m: int) -> npt.NDArray[np.int64]:
    """A shared read-only array of ``m`` zeros."""
    z = _ZEROS.get(m)
    if z is None:
        z = _ZEROS[m] = np.zeros(m, dtype=np.int64)
        z.flags.writeable = False
    return z
