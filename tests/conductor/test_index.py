import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake_conductor import keytable
from mooncake_conductor.index import DRAM, HBM, STORE, PrefixIndex


def test_match_all_one_pass() -> None:
    ix = PrefixIndex(100, instances=3)
    ix.store(0, [1, 2, 3])
    ix.store(1, [1, 2])
    ix.store(2, [9])
    assert ix.match_all([1, 2, 3, 4]) == {0: 3, 1: 2}
    assert ix.match_all([1, 2, 3, 4], mask=0b10) == {1: 2}
    assert ix.match(0, [1, 2, 3, 4]) == 3
    assert ix.match(2, [1, 2]) == 0


def test_lru_evicts_leaves_before_roots() -> None:
    ix = PrefixIndex(3, instances=1)
    evicted = ix.store(0, [1, 2, 3])
    assert evicted == []
    evicted = ix.store(0, [7])
    assert evicted == [3]  # the prefix's last block, not its root
    assert ix.match(0, [1, 2, 3]) == 2


def test_touch_and_demote_change_eviction_order() -> None:
    ix = PrefixIndex(3, instances=1)
    ix.store(0, [1])
    ix.store(0, [2])
    ix.store(0, [3])
    ix.touch(0, [1])
    assert ix.store(0, [4]) == [2]
    ix.demote(0, [4])
    assert ix.store(0, [5]) == [4]


def test_remove_and_clear() -> None:
    ix = PrefixIndex(10, instances=2)
    ix.store(0, [1, 2])
    ix.store(1, [1, 2])
    ix.remove(0, [2])
    assert ix.match_all([1, 2]) == {0: 1, 1: 2}
    ix.clear(1)
    assert ix.match_all([1, 2]) == {0: 1}
    assert ix.holder_mask(2) == 0
    ix.remove_instance(0)
    assert len(ix) == 0
    assert ix.match_all([1]) == {}


def test_pending_counts_only_when_asked() -> None:
    ix = PrefixIndex(10, instances=2)
    ix.store(0, [1])
    ix.add_pending(1, [1, 2])
    ix.add_pending(1, [1, 2])
    assert ix.match_all([1, 2]) == {0: 1}
    assert ix.match_all([1, 2], include_pending=True) == {0: 1, 1: 2}
    ix.remove_pending(1, [1, 2])
    assert ix.match(1, [1, 2], include_pending=True) == 2  # one reference left
    ix.remove_pending(1, [1, 2])
    assert ix.match(1, [1, 2], include_pending=True) == 0


def test_tiers() -> None:
    ix = PrefixIndex(10, instances=1)
    ix.store(0, [1, 2], DRAM)
    ix.store(0, [1], HBM)
    assert ix.tier_counts(0, [1, 2]) == {HBM: 1, DRAM: 1}


#: under mutation testing (``MUTANT_UNDER_TEST`` set) the property tests are backstops to
#: test_index_rules.py that every surviving mutant runs in full: fewer examples there
MUTATING = bool(os.environ.get("MUTANT_UNDER_TEST"))

ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear", "touch"]),
        st.integers(0, 3),
        st.lists(st.integers(0, 30), min_size=1, max_size=8),
    ),
    max_size=60,
)


@settings(max_examples=50 if MUTATING else 150, deadline=None)
@given(ops=ops, capacity=st.integers(1, 12), query=st.lists(st.integers(0, 30), max_size=10),
       base=st.sampled_from([0, 61, 4092]))
def test_index_invariants(
    ops: list[tuple[str, int, list[int]]], capacity: int, query: list[int], base: int
) -> None:
    """``base``: the instances are ids ``base`` to ``base + 3`` (past 63: wide masks,
    which the index shares between keys with the same holders)."""
    ix = PrefixIndex(capacity, instances=base + 4)
    model: list[set[int]] = [set() for _ in range(4)]
    for op, i, keys in ops:
        inst = base + i
        if op == "store":
            evicted = ix.store(inst, keys)
            model[i] |= set(keys)
            model[i] -= set(evicted)
        elif op == "remove":
            ix.remove(inst, keys)
            model[i] -= set(keys)
        elif op == "clear":
            ix.clear(inst)
            model[i] = set()
        else:
            ix.touch(inst, keys)
        # capacity is respected, and the index agrees with what was stored minus evictions
        assert ix.size(inst) <= capacity
        assert ix.blocks(inst) == model[i]
    # holder masks are exactly the instances whose tables hold the key
    for key in set().union(*model) | set(query):
        assert ix.holder_mask(key) == sum(1 << (base + i) for i in range(4) if key in model[i])
    matches = ix.match_all(query)
    for i in range(4):
        m = matches.get(base + i, 0)
        # a match never exceeds what is stored: every matched key is held
        assert all(k in model[i] for k in query[:m])
        if m < len(query):
            assert query[m] not in model[i]
        assert ix.match(base + i, query) == m


@settings(max_examples=30 if MUTATING else 80, deadline=None)
@given(keys=st.lists(st.integers(0, 1000), min_size=1, max_size=20, unique=True))
def test_removal_undoes_storage(keys: list[int]) -> None:
    ix = PrefixIndex(100, instances=2)
    ix.store(1, keys[:1])
    before = {k: ix.holder_mask(k) for k in keys}
    ix.store(0, keys)
    ix.remove(0, keys)
    assert {k: ix.holder_mask(k) for k in keys} == before
    assert ix.blocks(0) == set()


@pytest.mark.parametrize("max_load", [keytable.MAX_LOAD, 0.95])
def test_vectorised_matching_equals_the_dict_walk(
    monkeypatch: pytest.MonkeyPatch, max_load: float
) -> None:
    """Past ``vector_min_keys`` matching runs on the numpy mirror; every answer (and
    its order, which breaks ties downstream) must equal the dict walk's. A high table
    load puts many keys outside their home bucket (the lazily resolved case)."""
    monkeypatch.setattr(keytable, "MAX_LOAD", max_load)
    # under mutation testing half the trials (still every mask width, 3 to 130
    # instances, and every capacity)
    for trial in range(6 if MUTATING else 12):
        r = random.Random(trial)
        n_inst = r.choice([3, 64, 70, 130])  # 70 and 130: masks of several words
        cap = r.choice([5, 50, 500])
        walk = PrefixIndex(cap, instances=n_inst, vector_min_keys=10**9)
        vec = PrefixIndex(cap, instances=n_inst, vector_min_keys=1)
        chains = [[r.randrange(0, 2**64) if r.random() > 0.01 else 0
                   for _ in range(r.randint(1, 60))] for _ in range(20)]
        for _ in range(300):
            op, inst, chain = r.random(), r.randrange(n_inst), r.choice(chains)
            prefix = chain[: r.randint(1, len(chain))]
            for ix in (walk, vec):
                if op < 0.5:
                    ix.store(inst, prefix)
                elif op < 0.6:
                    ix.remove(inst, prefix[-3:])
                elif op < 0.7:
                    ix.add_pending(inst, prefix)
                elif op < 0.8:
                    ix.remove_pending(inst, prefix)
                elif op < 0.82:
                    ix.clear(inst)
            if op >= 0.82:
                mask = r.choice([-1, r.getrandbits(n_inst)])
                for pending in (False, True):
                    a = walk.match_all(chain, mask, pending)
                    b = vec.match_all(chain, mask, pending)
                    assert a == b and list(a) == list(b)
                # per-id lengths of both views (one compiled pass when ids fit one word)
                p_mask = r.choice([None, -1, mask, r.getrandbits(n_inst)])
                stored = walk.match_all(chain, mask)
                view = (stored if p_mask is None or not walk.has_pending
                        else walk.match_all(chain, p_mask, True))
                top = max(stored.values(), default=0)
                want = (stored, view,
                        next((i for i, v in stored.items() if v == top), None), top)
                for ix in (walk, vec):
                    got_s, got_v, best, length = ix.match_lengths(chain, mask, p_mask)
                    got = ({i: int(v) for i, v in enumerate(got_s) if v},
                           {i: int(v) for i, v in enumerate(got_v) if v}, best, length)
                    assert got == want
        assert vec._mirror is not None and walk._mirror is None


def test_vectorised_mirror_is_dropped_when_the_index_shrinks() -> None:
    ix = PrefixIndex(1000, instances=2, vector_min_keys=100)
    ix.store(0, list(range(1, 201)))
    assert ix.match_all(list(range(1, 11))) == {0: 10}
    assert ix._mirror is not None
    ix.clear(0)
    ix.store(1, [1, 2])
    assert ix.match_all([1, 2, 3]) == {1: 2}
    assert ix._mirror is None


def test_match_lengths_covers_every_id_asked_about() -> None:
    for vector_min_keys in (1, 10**9):
        ix = PrefixIndex(100, instances=2, vector_min_keys=vector_min_keys)
        ix.store(0, [1, 2, 3])
        ix.add_pending(1, [1, 2])
        stored, view, best, length = ix.match_lengths([1, 2, 3], (1 << 100) | 3, 1 << 70 | 3)
        assert len(stored) > 100 and len(view) > 100
        assert (stored[0], stored[1], stored[100], view[1], best, length) == (3, 0, 0, 2, 0, 3)


def test_engine_media_map_to_tiers() -> None:
    from mooncake_conductor.index import DRAM, HBM, STORE, tier_of_medium

    assert tier_of_medium(None) == HBM and tier_of_medium("GPU") == HBM
    assert tier_of_medium("cpu") == DRAM  # names are matched case-insensitively
    assert tier_of_medium("CPU_TIER1") == DRAM and tier_of_medium("CPU_TIER2") == DRAM
    assert {tier_of_medium(m) for m in ("STORAGE", "FS", "OBJ", "DISK")} == {STORE}
    assert tier_of_medium("SOMETHING_NEW") == STORE  # never priced as HBM


class _OneKeyAtATime:
    """The index's bookkeeping rules written one key at a time, plainly: the reference
    the batched passes of :class:`PrefixIndex` must match step for step."""

    def __init__(self, capacity: int, instances: int) -> None:
        self.capacity = capacity
        self.lru: list[dict[int, int]] = [{} for _ in range(instances)]
        self.refs: list[dict[int, int]] = [{} for _ in range(instances)]
        self.evictions = 0

    def store(self, inst: int, keys: list[int], tier: int) -> list[int]:
        table = self.lru[inst]
        for key in reversed(keys):
            held = table.pop(key, None)
            table[key] = tier if held is None else min(held, tier)
        evicted = []
        while len(table) > self.capacity:
            oldest = next(iter(table))
            del table[oldest]
            evicted.append(oldest)
        self.evictions += len(evicted)
        return evicted

    def add_pending(self, inst: int, keys: list[int]) -> None:
        for key in keys:
            self.refs[inst][key] = self.refs[inst].get(key, 0) + 1

    def remove_pending(self, inst: int, keys: list[int]) -> None:
        for key in keys:
            count = self.refs[inst].get(key, 0)
            if count > 1:
                self.refs[inst][key] = count - 1
            elif count:
                del self.refs[inst][key]

    def clear(self, inst: int) -> None:
        self.lru[inst] = {}
        self.refs[inst] = {}

    def holders(self) -> dict[int, int]:
        return _masks(self.lru)

    def pending(self) -> dict[int, int]:
        return _masks(self.refs)


def _masks(tables: list[dict[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for inst, table in enumerate(tables):
        for key in table:
            out[key] = out.get(key, 0) | 1 << inst
    return out


bookkeeping = st.lists(
    st.tuples(
        st.sampled_from(["store", "add_pending", "remove_pending", "clear"]),
        st.integers(0, 2),
        st.lists(st.integers(0, 12), max_size=8),  # small key range: repeats within a call
        st.sampled_from([HBM, DRAM, STORE]),
    ),
    max_size=50,
)


@settings(max_examples=60 if MUTATING else 200, deadline=None)
@given(ops=bookkeeping, capacity=st.integers(1, 10))
def test_batched_bookkeeping_matches_one_key_at_a_time(
    ops: list[tuple[str, int, list[int], int]], capacity: int
) -> None:
    """Storing (LRU order, tiers, evictions, holders) and pending references give, after
    every step, what taking the keys one at a time gives, repeated keys included."""
    ix = PrefixIndex(capacity, instances=3)
    ref = _OneKeyAtATime(capacity, 3)
    for op, inst, keys, tier in ops:
        if op == "store":
            assert ix.store(inst, keys, tier) == ref.store(inst, keys, tier)
        elif op == "add_pending":
            ix.add_pending(inst, keys)
            ref.add_pending(inst, keys)
        elif op == "remove_pending":
            ix.remove_pending(inst, keys)
            ref.remove_pending(inst, keys)
        else:
            ix.clear(inst)
            ref.clear(inst)
        for i in range(3):
            table = ix._lru[i]
            assert table is not None and list(table.items()) == list(ref.lru[i].items())
        assert ix.holders == ref.holders()
        assert ix._pending == ref.pending()
        assert ix.evictions == ref.evictions
