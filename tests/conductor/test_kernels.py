"""The compiled rankings price exactly as the cost model does and rank exactly as the
conductor's named stages do (:mod:`mooncake_conductor.scoring`), bit for bit."""

from __future__ import annotations

import random

import numpy as np
from mooncake_conductor.cost import CostModel, CostModelConfig, EfficiencySpec
from mooncake_conductor.scoring import Option, pool_prices, score, slo_guard, tie_band
from mooncake_conductor.scoring_kernel import rank_fifo

from .helpers import COST


def _reference(cost, now, n, block, best_len, best_pos, weight, shut_rate, slo_s, open_s,
               overlap, tol, tol_s, up, busy_until, qwork, qlen,
               local):  # type: ignore[no-untyped-def]
    """The conductor's FIFO ranking as its named stages (:mod:`mooncake_conductor.scoring`)
    over :class:`CostModel`'s times: each live row's option (recompute, or fetch when
    that is faster), the scorers' sum, the SLO guard and the tie band; rows that are not
    up score infinity and never tie."""
    m = len(busy_until)
    live = [i for i in range(m) if up[i]]
    fifo = [(b - now if b > now else 0.0) + w for b, w in zip(busy_until, qwork, strict=True)]
    prices = pool_prices([fifo[i] for i in live], [qlen[i] for i in live],
                         [busy_until[i] > now for i in live], weight, shut_rate, open_s)
    best_tokens = min(best_len * block, n)
    options = []
    for pos, i in enumerate(live):
        held_tokens = min(local[i] * block, n)
        option = Option(i, local[i], 0, fifo[i], 0.0, cost.prefill_time(n, held_tokens), 0.0,
                        pos)
        if best_len > local[i] and i != best_pos:
            transfer = cost.transfer_time(best_tokens - held_tokens)
            fetched = Option(i, local[i], best_len - local[i], fifo[i],
                             max(0.0, transfer - fifo[i]) if overlap else transfer,
                             cost.prefill_time(n, best_tokens), 0.0, pos)
            if fetched.ttft_s < option.ttft_s:
                option = fetched
        options.append(option)
    live_scores = slo_guard(options, [score(o, prices) for o in options], slo_s, prices)
    scores, fetches = [float("inf")] * m, [False] * m
    for o, sc in zip(options, live_scores, strict=True):
        scores[o.iid], fetches[o.iid] = sc, bool(o.fetch)
    ties = [options[k].iid for k in tie_band(options, live_scores, tol, tol_s)]
    return scores, fetches, ties, prices.kappa


def test_rank_fifo_equals_the_cost_model_bit_for_bit() -> None:
    r = random.Random(5)
    models = [COST, CostModel(CostModelConfig(efficiency=EfficiencySpec(mfu_half_tokens=1)))]
    for _ in range(400):
        cost = r.choice(models)
        m = r.choice([1, 2, 7, 64])
        block = r.choice([16, 512])
        n = r.randint(1, 40_000)
        local = [r.choice([0, 0, r.randint(0, n // block + 2)]) for _ in range(m)]
        best_len = max([*local, r.choice([0, r.randint(0, n // block + 2)])])
        best_pos = r.choice([-1, *[i for i in range(m) if local[i] == best_len]])
        now = r.random() * 10
        busy_until = [r.choice([0.0, now, now + r.random() * 5]) for _ in range(m)]
        qwork = [r.choice([0.0, 0.0, r.random() * 8]) for _ in range(m)]
        qlen = [r.choice([0, 0, r.randint(1, 5)]) for _ in range(m)]
        up = [r.random() < 0.9 for _ in range(m)]
        up[r.randrange(m)] = True
        args = (now, n, block, best_len, best_pos, r.choice([0.0, 1.0, 2.5]),
                r.choice([0.0, 0.0, 0.5, 6.0]), r.choice([30.0, 4.0, 1.0]),
                r.choice([15.0, 2.0, 0.5]), r.random() < 0.8,
                r.choice([0.0, 0.02]),
                r.choice([0.0, 0.005]))
        score, fetch = np.empty(m), np.empty(m, dtype=np.bool_)
        ties = np.empty(m, dtype=np.int64)
        ids = r.sample(range(m + 3), m)  # position -> instance id; local is kept by id
        by_id = np.zeros(m + 3, dtype=np.int64)
        by_id[ids] = local
        count, kappa = rank_fifo(
            np.array(cost.prefill_constants()), *args, np.array(up), np.array(busy_until),
            np.array(qwork), np.array(qlen, dtype=np.int64), np.array(ids, dtype=np.int64),
            by_id, score, fetch, ties)
        want = _reference(cost, *args, up, busy_until, qwork, qlen, local)
        assert (score.tolist(), fetch.tolist(), ties[:count].tolist(), kappa) == want


def test_kernels_close_over_no_dispatcher() -> None:
    """numba keys its on-disk cache on the pickled closure of a kernel, and a compiled
    function pickles differently in every process: a kernel closing over one is never
    found in the cache and is compiled again by every process (seconds each)."""
    from mooncake_conductor import blockkeys_kernel, decode_kernel, kernels, scoring_kernel
    from numba.core.dispatcher import Dispatcher

    compiled = [*kernels._compile(), kernels._compile_lengths_sets(), kernels._compile_upsert(),
                blockkeys_kernel._compile_chain(), *scoring_kernel._compile_rank(),
                decode_kernel._compile_decode()]
    for fn in compiled:
        cells = fn.py_func.__closure__ or ()
        assert not [c for c in cells if isinstance(c.cell_contents, Dispatcher)], fn


