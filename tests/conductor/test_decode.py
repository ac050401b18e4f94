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
