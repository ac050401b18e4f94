"""Each decode selector's rule on two or three hand-made instances."""

import random

import pytest
from mooncake_conductor.cost import CostModel, CostModelConfig, HardwareSpec
from mooncake_conductor.decode import DecodeSelector, create_decode_selector
from mooncake_conductor.state import DecodeState

from .helpers import COST, request

KEYS = list(range(20))  # 10240 tokens
N = 20 * 512


def selector(name: str, tbt_s: float = 0.1, seed: int = 0) -> DecodeSelector:
    return create_decode_selector(name, COST, tbt_s, random.Random(seed))


def inst(iid: int, batch: int = 0, context: int = 0, *, waiting: int = 0, reserved: int = 0,
         capacity: int = 0, rate: float = 0.0, up: bool = True) -> DecodeState:
    return DecodeState(iid=iid, batch=batch, context_tokens=context, waiting=waiting,
                       reserved_tokens=reserved, capacity_tokens=capacity, tokens_per_s=rate,
                       up=up)


# -- least-load -------------------------------------------------------------------------------

def test_least_load_counts_waiting_requests() -> None:
    # running 2 + waiting 3 is more load than running 4
    ds = [inst(0, 2, 1000, waiting=3), inst(1, 4, 1000)]
    ch = selector("least-load").choose(request(KEYS), ds)
    assert ch.decode == 1 and ch.reject_reason is None


def test_least_load_counts_running_requests() -> None:
    ds = [inst(0, 3, 1000), inst(1, 1, 50_000, waiting=1)]
    assert selector("least-load").choose(request(KEYS), ds).decode == 1


def test_least_load_breaks_equal_loads_by_kv_in_use() -> None:
    # 3 requests each; instance 1 has less of its KV capacity in use
    ds = [inst(0, 3, 800, capacity=1000), inst(1, 2, 100, waiting=1, reserved=100,
                                                 capacity=1000)]
    assert selector("least-load").choose(request(KEYS), ds).decode == 1
    ds[1].context_tokens = 900
    assert selector("least-load").choose(request(KEYS), ds).decode == 0


def test_least_load_skips_down_instances_and_predicts_the_step() -> None:
    ds = [inst(0, up=False), inst(1, 5, 7000)]
    ch = selector("least-load").choose(request(KEYS), ds)
    assert ch.decode == 1
    assert ch.predicted_tbt_s == COST.decode_step_time(6, 7000 + N)


def test_least_load_ties_are_drawn_at_random() -> None:
    ds = [inst(0, 2, 500), inst(1, 2, 500), inst(2, 3, 0)]
    sel = selector("least-load", seed=1)
    assert {sel.choose(request(KEYS), ds).decode for _ in range(40)} == {0, 1}


# -- aibrix -----------------------------------------------------------------------------------

def test_aibrix_penalises_an_instance_past_90_percent_kv() -> None:
    """ms = 1000 / rate * (1 + 1 / batch): 10 * 1.5 = 15 ms against 12.5 * 1.5 = 18.75 ms;
    x1.5 past 90% KV use makes the faster one 22.5 ms: the slower one wins."""
    fast_full = inst(0, 2, 950, capacity=1000, rate=100.0)
    slow = inst(1, 2, 500, capacity=1000, rate=80.0)
    assert selector("aibrix").choose(request(KEYS), [fast_full, slow]).decode == 1
    assert selector("aibrix").choose(request(KEYS), [slow, fast_full]).decode == 1
    fast_full.context_tokens = 500  # not full any more: the faster one wins
    assert selector("aibrix").choose(request(KEYS), [fast_full, slow]).decode == 0


def test_aibrix_kv_use_counts_reserved_tokens_and_90_percent_is_not_full() -> None:
    fast = inst(0, 2, 400, reserved=500, capacity=1000, rate=100.0)  # exactly 90%
    slow = inst(1, 2, 0, capacity=1000, rate=80.0)
    assert selector("aibrix").choose(request(KEYS), [fast, slow]).decode == 0
    fast.reserved_tokens = 501  # 90.1%: penalised
    assert selector("aibrix").choose(request(KEYS), [fast, slow]).decode == 1


def test_aibrix_penalty_cannot_outweigh_a_large_gap() -> None:
    # 10 ms x 1.5 = 15 ms still beats 20 ms
    full = inst(0, 1, 990, capacity=1000, rate=100.0)
    slow = inst(1, 1, 0, capacity=1000, rate=50.0)
    assert selector("aibrix").choose(request(KEYS), [full, slow]).decode == 0


def test_aibrix_estimate_shrinks_with_the_batch() -> None:
    # same rate: batch 1 -> 2 x 10 ms, batch 4 -> 1.25 x 10 ms; batch 0 counts as 1
    ds = [inst(0, 1, 0, rate=100.0), inst(1, 4, 0, rate=100.0)]
    assert selector("aibrix").choose(request(KEYS), ds).decode == 1
    ds = [inst(0, 0, 0, rate=100.0), inst(1, 2, 0, rate=90.0)]
    # batch 0: 2 x 10 = 20 ms; batch 2: 1.5 x 11.1 = 16.7 ms
    assert selector("aibrix").choose(request(KEYS), ds).decode == 1


# decode steps memory-bound (the default) and compute-bound (HBM 1000x faster): a step's
# batch size matters only in the latter
COMPUTE_BOUND = CostModel(CostModelConfig(hardware=HardwareSpec(hbm_gbps_per_gpu=2_039_000.0)))


@pytest.mark.parametrize("cost", [COST, COMPUTE_BOUND], ids=["memory-bound", "compute-bound"])
def test_aibrix_idle_instance_uses_the_cost_models_single_step(cost: CostModel) -> None:
    """No measured rate: ``1 / decode_step_time(1, prompt)``; batch 0 counts as 1."""
    idle_ms = 2 * 1000.0 * cost.decode_step_time(1, N)
    just_faster = 2 * 1000.0 / (idle_ms * 0.99)  # a rate whose estimate is 1% smaller
    just_slower = 2 * 1000.0 / (idle_ms * 1.01)
    for rate, want in ((just_faster, 0), (just_slower, 1)):
        ds = [inst(0, 1, 0, rate=rate), inst(1)]
        sel = create_decode_selector("aibrix", cost, 0.1, random.Random(0))
        ch = sel.choose(request(KEYS), ds)
        assert ch.decode == want, rate
        assert ch.predicted_tbt_s == cost.decode_step_time(
            ds[want].batch + 1, ds[want].context_tokens + N)


def test_aibrix_skips_down_instances() -> None:
    ds = [inst(0, 4, 0, rate=1000.0, up=False), inst(1, 1, 0, rate=10.0)]
    assert selector("aibrix").choose(request(KEYS), ds).decode == 1
    ds[1].up = False
    assert selector("aibrix").choose(request(KEYS), ds).reject_reason == "no-decode-instance"


# -- tbt-slo ----------------------------------------------------------------------------------

def test_tbt_slo_step_exactly_at_the_slo_is_within_it() -> None:
    d = inst(0, 10, 50_000)
    step = COST.decode_step_time(11, 50_000 + N)
    ch = selector("tbt-slo", tbt_s=step).choose(request(KEYS), [d])
    assert (ch.decode, ch.reject_reason, ch.predicted_tbt_s) == (0, None, step)
    ch = selector("tbt-slo", tbt_s=step * (1 - 1e-12)).choose(request(KEYS), [d])
    assert (ch.decode, ch.reject_reason) == (0, "tbt-slo")


def test_tbt_slo_room_counts_context_reservations_and_the_whole_request() -> None:
    need = N + 100  # prompt plus output
    d = inst(0, 2, 3000, reserved=4000, capacity=3000 + 4000 + need)
    assert selector("tbt-slo").choose(request(KEYS, output=100), [d]).reject_reason is None
    d.capacity_tokens -= 1
    ch = selector("tbt-slo").choose(request(KEYS, output=100), [d])
    assert (ch.decode, ch.reject_reason) == (0, "tbt-slo")
    d.capacity_tokens = 0  # unknown capacity: no limit
    assert selector("tbt-slo").choose(request(KEYS, output=100), [d]).reject_reason is None


def test_tbt_slo_without_room_takes_the_next_fastest_with_room() -> None:
    fast_full = inst(0, 1, 1000, capacity=N)  # no room for prompt + output
    slower = inst(1, 20, 200_000, capacity=COST.kv_capacity_tokens)
    ch = selector("tbt-slo").choose(request(KEYS), [fast_full, slower])
    assert (ch.decode, ch.reject_reason) == (1, None)
    assert ch.predicted_tbt_s == COST.decode_step_time(21, 200_000 + N)


def test_tbt_slo_ties_within_one_percent_are_drawn_at_random() -> None:
    base = inst(0, 10, 100_000)
    step = COST.decode_step_time(11, 100_000 + N)
    # a context whose step is 0.5% slower ties; one 2% slower does not
    per_token = COST.decode_step_time(11, 100_001 + N) - step
    near = inst(1, 10, 100_000 + int(0.005 * step / per_token))
    far = inst(2, 10, 100_000 + int(0.02 * step / per_token))
    sel = selector("tbt-slo", seed=3)
    picks = {sel.choose(request(KEYS), [base, near, far]).decode for _ in range(40)}
    assert picks == {0, 1}


def test_tbt_slo_skips_down_instances() -> None:
    ds = [inst(0, 0, 0, up=False), inst(1, 50, 400_000)]
    ch = selector("tbt-slo", tbt_s=10.0).choose(request(KEYS), ds)
    assert ch.decode == 1


@pytest.mark.parametrize("name", ["random", "round-robin"])
def test_load_blind_selectors_skip_down_instances(name: str) -> None:
    ds = [inst(0, up=False), inst(1), inst(2, up=False)]
    sel = selector(name)
    assert {sel.choose(request(KEYS), ds).decode for _ in range(5)} == {1}
    for d in ds:
        d.up = False
    assert sel.choose(request(KEYS), ds).reject_reason == "no-decode-instance"


# -- every selector: nothing up, and what it predicts ------------------------------------------

@pytest.mark.parametrize("name", ["random", "round-robin", "least-load", "tbt-slo", "aibrix"])
def test_no_live_decode_instance_is_a_named_rejection(name: str) -> None:
    ch = selector(name).choose(request(KEYS), [inst(0, up=False), inst(1, up=False)])
    assert (ch.decode, ch.reject_reason) == (None, "no-decode-instance")
    assert selector(name).choose(request(KEYS), []).reject_reason == "no-decode-instance"


@pytest.mark.parametrize("name", ["random", "round-robin", "least-load", "aibrix"])
def test_the_predicted_step_is_the_chosen_instances_next_step(name: str) -> None:
    ds = [inst(0, 3, 9000, rate=40.0), inst(1, 5, 20_000, rate=40.0)]
    ch = selector(name).choose(request(KEYS), ds)
    d = ds[ch.decode or 0]
    assert ch.predicted_tbt_s == pytest.approx(COST.decode_step_time(d.batch + 1,
                                                                     d.context_tokens + N))


def test_aibrix_estimate_weighs_the_batch_term_as_one_over_the_batch() -> None:
    # (1000 / tps) * (1 + 1 / batch): 19.63 ms on a big slow batch beats 20 ms alone
    # at 100 tokens/s; counted as (2 + 1/batch) or (1 + 2/batch) the order flips
    ds = [inst(0, 1000, 1000, rate=51.0), inst(1, 1, 1000, rate=100.0)]
    assert selector("aibrix").choose(request(KEYS), ds).decode == 0
    ds = [inst(0, 1, 1000, rate=100.0), inst(1, 4, 1000, rate=60.0)]
    assert selector("aibrix").choose(request(KEYS), ds).decode == 0  # 20 < 20.83 ms
