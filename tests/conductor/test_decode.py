import random

import pytest
from mooncake_conductor.decode import create_decode_selector
from mooncake_conductor.state import DecodeState

from .helpers import COST, request

KEYS = list(range(20))


def selector(name: str, tbt_ms: float = 100.0, seed: int = 0):  # type: ignore[no-untyped-def]
    return create_decode_selector(name, COST, tbt_ms / 1000.0, random.Random(seed))


def decoders(*batches: tuple[int, int]) -> list[DecodeState]:
    return [
        DecodeState(iid=i, batch=b, context_tokens=ctx, capacity_tokens=COST.kv_capacity_tokens)
        for i, (b, ctx) in enumerate(batches)
    ]


def test_tbt_slo_picks_lowest_predicted_step() -> None:
    ds = decoders((40, 600_000), (10, 100_000), (30, 400_000))
    ch = selector("tbt-slo").choose(request(KEYS), ds)
    assert ch.decode == 1 and ch.reject_reason is None
    assert ch.predicted_tbt_s == pytest.approx(COST.decode_step_time(11, 100_000 + 20 * 512))


def test_tbt_slo_rejects_when_every_instance_would_break_it() -> None:
    ds = decoders((200, 1_300_000), (220, 1_300_000))
    ch = selector("tbt-slo", tbt_ms=20.0).choose(request(KEYS), ds)
    assert ch.reject_reason == "tbt-slo" and ch.decode is not None


def test_tbt_slo_respects_kv_capacity() -> None:
    ds = decoders((1, 1000), (5, 5000))
    ds[0].capacity_tokens = 5000  # no room for 10k prompt + output
    assert selector("tbt-slo").choose(request(KEYS), ds).decode == 1


def test_least_load_random_round_robin_aibrix() -> None:
    ds = decoders((4, 1000), (1, 1000), (3, 1000))
    assert selector("least-load").choose(request(KEYS), ds).decode == 1
    rr = selector("round-robin")
    assert [rr.choose(request(KEYS), ds).decode for _ in range(4)] == [0, 1, 2, 0]
    rnd = selector("random", seed=4)
    assert {rnd.choose(request(KEYS), ds).decode for _ in range(60)} == {0, 1, 2}
    for d in ds:
        d.tokens_per_s = 1.0 / COST.decode_step_time(d.batch, d.context_tokens)
    assert selector("aibrix").choose(request(KEYS), ds).decode in (0, 1, 2)


def test_down_and_unknown() -> None:
    ds = decoders((1, 1))
    ds[0].up = False
    assert selector("tbt-slo").choose(request(KEYS), ds).reject_reason == "no-decode-instance"
    with pytest.raises(KeyError, match="unknown decode selector"):
        selector("nope")


def _tbt_slo_by_pricing_all(req, decode, rng, slo_s):  # type: ignore[no-untyped-def]
    """The rule in plain Python over the cost model (what the compiled selector must
    equal): ``(instance, reject reason, predicted step)``."""
    from mooncake_conductor.policies.base import least

    need = req.input_tokens + req.output_tokens
    options, fallback = [], None
    for d in decode:
        if not d.up:
            continue
        step = COST.decode_step_time(d.batch + 1, d.context_tokens + req.input_tokens)
        if fallback is None or step < fallback[0]:
            fallback = (step, d.iid)
        if step <= slo_s and (d.capacity_tokens <= 0 or
                              d.context_tokens + d.reserved_tokens + need <= d.capacity_tokens):
            options.append((step, d.iid))
    if fallback is None:
        return None, "no-decode-instance", 0.0
    if not options:
        return fallback[1], "tbt-slo", fallback[0]
    iid = least(options, rng, rel_tol=0.01)
    return iid, None, next(s for s, i in options if i == iid)


def test_tbt_slo_compiled_pricing_equals_the_cost_model() -> None:
    """Same choices, same random draws and the same predicted step, bit for bit."""
    r = random.Random(3)
    for trial in range(300):
        n = r.choice([1, 4, 64])
        cap = COST.kv_capacity_tokens
        decode = [
            DecodeState(
                iid=i, up=r.random() > 0.1,
                batch=r.choice([0, 0, r.randint(0, 256)]),
                context_tokens=r.choice([0, 0, r.randint(0, cap)]),
                capacity_tokens=r.choice([0, cap]),
                reserved_tokens=r.randint(0, cap // 4),
            )
            for i in range(n)
        ]
        req = request(list(range(r.randint(1, 64))), output=r.randint(1, 2000))
        slo = r.choice([0.02, 0.05, 0.1, 1.0])
        sel = create_decode_selector("tbt-slo", COST, slo, random.Random(trial))
        got = sel.choose(req, decode)
        want = _tbt_slo_by_pricing_all(req, decode, random.Random(trial), slo)
        assert (got.decode, got.reject_reason, got.predicted_tbt_s) == want


def test_tbt_slo_rejection_names_the_first_of_the_fastest() -> None:
    decode = [DecodeState(iid=i, batch=b, context_tokens=1000) for i, b in
              enumerate([3, 1, 1, 2])]
    decode[0].up = False
    got = create_decode_selector("tbt-slo", COST, 1e-6, random.Random(0)).choose(
        request([1, 2]), decode)
    assert (got.decode, got.reject_reason) == (1, "tbt-slo")
    assert got.predicted_tbt_s == COST.decode_step_time(2, 1000 + request([1, 2]).input_tokens)
