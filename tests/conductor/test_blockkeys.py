import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake_conductor import blockkeys
from mooncake_conductor.blockkeys import (
    MASK64,
    P,
    block_keys,
    block_keys_reference,
    mix64,
    namespace_seed,
    trace_block_keys,
    trace_block_keys_many,
)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "block-keys.json").read_text())


@pytest.fixture(params=["numpy", "compiled"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both implementations of :func:`block_keys`, the numpy one with
    its per-block-size tables built afresh (a table cached by an earlier test would hide a
    fault in building it)."""
    numpy = request.param == "numpy"
    monkeypatch.setattr(blockkeys, "COMPILED_MIN_TOKENS", 10**9 if numpy else 0)
    monkeypatch.setattr(blockkeys, "chain_loaded", lambda: not numpy)
    monkeypatch.setattr(blockkeys, "_POWERS", {})
    return str(request.param)


@pytest.mark.parametrize("case", GOLDEN["tokens"], ids=lambda c: f"{c['model']}-{c['block_size']}")
def test_golden_vectors(case: dict, path: str) -> None:
    seed = namespace_seed(case["model"], case["block_size"], case["lora"], case["salt"])
    assert seed == case["seed"]
    assert block_keys_reference(case["tokens"], case["block_size"], seed) == case["keys"]
    assert block_keys(case["tokens"], case["block_size"], seed) == case["keys"]


def test_golden_trace_keys() -> None:
    tr = GOLDEN["trace"]
    assert GOLDEN["P"] == P
    assert trace_block_keys(tr["hash_ids"], tr["seed"]) == tr["keys"]


def test_only_full_blocks_get_keys() -> None:
    seed = namespace_seed("m", 16)
    assert block_keys(list(range(15)), 16, seed) == []
    assert len(block_keys(list(range(47)), 16, seed)) == 2


def test_keys_chain_the_whole_prefix() -> None:
    seed = namespace_seed("m", 4)
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, seed)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, seed)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same block contents, different prefix
    c = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1], 4, seed)
    assert c[:2] == a


@pytest.mark.parametrize("field", ["model", "block", "lora", "salt"])
def test_namespace_separates(field: str) -> None:
    base = {"model": "m", "block": 16, "lora": "", "salt": ""}
    other = dict(base)
    other[field] = 32 if field == "block" else "x"
    s1 = namespace_seed(base["model"], base["block"], base["lora"], base["salt"])
    s2 = namespace_seed(other["model"], other["block"], other["lora"], other["salt"])
    assert s1 != s2
    tokens = list(range(64))
    assert not set(block_keys(tokens, 16, s1)) & set(block_keys(tokens, 16, s2))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=200),
    block=st.integers(1, 32),
    seed=st.integers(0, 2**64 - 1),
)
def test_vectorised_equals_reference(tokens: list[int], block: int, seed: int) -> None:
    want = block_keys_reference(tokens, block, seed)
    saved = blockkeys.COMPILED_MIN_TOKENS, blockkeys.chain_loaded, blockkeys._POWERS
    for compiled in (False, True):  # the numpy formulation, the compiled loop
        blockkeys.COMPILED_MIN_TOKENS = 0 if compiled else 10**9
        blockkeys.chain_loaded = lambda c=compiled: c  # type: ignore[misc]
        blockkeys._POWERS = {}  # tables built afresh for this block size
        try:
            assert block_keys(tokens, block, seed) == want
            assert block_keys(np.asarray(tokens, dtype=np.int64), block, seed) == want
            assert block_keys(np.asarray(tokens, dtype=np.uint32), block, seed) == want
        finally:
            blockkeys.COMPILED_MIN_TOKENS, blockkeys.chain_loaded, blockkeys._POWERS = saved


def test_long_prompts_take_the_compiled_path_and_agree() -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 2**31 - 1, size=blockkeys.COMPILED_MIN_TOKENS + 100)
    seed = namespace_seed("m", 16)
    assert block_keys(tokens, 16, seed) == block_keys_reference(tokens.tolist(), 16, seed)


def test_mix64_is_a_bijection_sample() -> None:
    outs = {mix64(i) for i in range(10_000)}
    assert len(outs) == 10_000


@pytest.mark.parametrize("size", [0, -1])
def test_bad_block_size(size: int) -> None:
    with pytest.raises(ValueError, match=r"^block_size must be positive$"):
        block_keys([1, 2], size, 1)
    with pytest.raises(ValueError, match=r"^block_size must be positive$"):
        block_keys_reference([1, 2], size, 1)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.uint64])
def test_token_arrays_of_any_integer_type(dtype: type, path: str) -> None:
    """Engines hand token ids as int32 or int64 arrays; the keys do not depend on it."""
    tokens = [0, 7, 2**31 - 1, 5, 1, 9, 3, 4, 100]
    seed = namespace_seed("m", 4)
    want = block_keys_reference(tokens, 4, seed)
    assert len(want) == 2
    assert block_keys(np.asarray(tokens, dtype=dtype), 4, seed) == want


def test_no_full_block_gives_an_empty_uint64_array(path: str) -> None:
    out = blockkeys.block_keys_array([1, 2, 3], 4, 9)
    assert out.dtype == np.uint64
    assert out.shape == (0,)


def test_namespace_seed_defaults_are_no_lora_and_no_salt() -> None:
    case = next(c for c in GOLDEN["tokens"] if c["lora"] == "" and c["salt"] == "")
    assert namespace_seed(case["model"], case["block_size"]) == case["seed"]


def test_block_powers_tables() -> None:
    """The numpy path's tables: ``weights[j] = P^(B-1-j)``, ``ones = sum(weights)``,
    ``fwd[k] = Q^k`` and ``inv[k] = Q^-k`` with ``Q = P^B``, grown on demand."""
    mod = 1 << 64
    for b in (1, 3, 16):
        pw = blockkeys._BlockPowers(b)
        assert pw.weights.dtype == np.uint64
        assert pw.weights.tolist() == [pow(P, b - 1 - j, mod) for j in range(b)]
        assert int(pw.ones) == sum(pow(P, b - 1 - j, mod) for j in range(b)) % mod
        q = pow(P, b, mod)
        assert pw.q == q
        assert (pw.q * pw.q_inv) % mod == 1
        assert pw.fwd.tolist() == [1] and pw.inv.tolist() == [1]
        pw.ensure(0)
        assert len(pw.fwd) == 1  # already enough
        pw.ensure(5)
        assert len(pw.fwd) == len(pw.inv) == 6
        assert pw.fwd.dtype == pw.inv.dtype == np.uint64
        assert pw.fwd.tolist() == [pow(q, k, mod) for k in range(6)]
        assert pw.inv.tolist() == [pow(pw.q_inv, k, mod) for k in range(6)]
        pw.ensure(6)  # grows to at least double, keeping what it had
        assert len(pw.fwd) == 12
        assert pw.fwd.tolist() == [pow(q, k, mod) for k in range(12)]
        assert pw.inv.tolist() == [pow(pw.q_inv, k, mod) for k in range(12)]
        pw.ensure(30)
        assert len(pw.fwd) == 31
        assert pw.fwd.tolist()[-1] == pow(q, 30, mod)


def test_trace_keys_of_a_whole_trace_equal_one_request_at_a_time() -> None:
    tr = GOLDEN["trace"]
    seqs = [tr["hash_ids"], [], tr["hash_ids"][:3], [0, 1, MASK64 - 1, MASK64]]
    assert trace_block_keys_many(seqs, tr["seed"]) == [
        trace_block_keys(ids, tr["seed"]) for ids in seqs]
    assert trace_block_keys_many(seqs, tr["seed"])[0] == tr["keys"]
    # ids numpy cannot hold take the Python path, with the same result
    odd = [[-1, 5], [1 << 70]]
    assert trace_block_keys_many(odd, tr["seed"]) == [
        trace_block_keys(ids, tr["seed"]) for ids in odd]
