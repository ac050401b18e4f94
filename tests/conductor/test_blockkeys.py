import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake_conductor import blockkeys
from mooncake_conductor.blockkeys import (
    P,
    block_keys,
    block_keys_reference,
    mix64,
    namespace_seed,
    trace_block_keys,
)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "block-keys.json").read_text())


@pytest.fixture(params=["numpy", "compiled"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through both implementations of :func:`block_keys`."""
    numpy = request.param == "numpy"
    monkeypatch.setattr(blockkeys, "COMPILED_MIN_TOKENS", 10**9 if numpy else 0)
    monkeypatch.setattr(blockkeys, "chain_loaded", lambda: not numpy)
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
    saved = blockkeys.COMPILED_MIN_TOKENS, blockkeys.chain_loaded
    for compiled in (False, True):  # the numpy formulation, the compiled loop
        blockkeys.COMPILED_MIN_TOKENS = 0 if compiled else 10**9
        blockkeys.chain_loaded = lambda c=compiled: c  # type: ignore[misc]
        try:
            assert block_keys(tokens, block, seed) == want
            assert block_keys(np.asarray(tokens, dtype=np.int64), block, seed) == want
        finally:
            blockkeys.COMPILED_MIN_TOKENS, blockkeys.chain_loaded = saved


def test_long_prompts_take_the_compiled_path_and_agree() -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 2**31 - 1, size=blockkeys.COMPILED_MIN_TOKENS + 100)
    seed = namespace_seed("m", 16)
    assert block_keys(tokens, 16, seed) == block_keys_reference(tokens.tolist(), 16, seed)


def test_mix64_is_a_bijection_sample() -> None:
    outs = {mix64(i) for i in range(10_000)}
    assert len(outs) == 10_000


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, 1)
    with pytest.raises(ValueError):
        block_keys_reference([1, 2], -1, 1)
