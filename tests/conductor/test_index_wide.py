"""The compiled walk over wide masks (instance ids past 63) finds every instance's
longest prefix, stored and stored-or-pending, as the dictionary walk does."""

from __future__ import annotations

import random

from mooncake_conductor.index import PrefixIndex


def test_wide_lengths_equal_the_dictionary_walk() -> None:
    r = random.Random(17)
    for trial in range(40):
        ids = r.sample(range(300), r.choice([3, 20, 70]))
        big = PrefixIndex(400, vector_min_keys=1)  # the mirror from the first key
        small = PrefixIndex(400, vector_min_keys=1 << 30)  # never: the dict walk
        chains = [[r.getrandbits(64) for _ in range(40)] for _ in range(4)]
        if trial % 5 == 0:
            chains[0][0] = 0  # the key 0 is kept aside in the mirror
        for ix in (big, small):
            for i in ids:
                ix.add_instance(i)
        for _ in range(60):
            i, chain = r.choice(ids), r.choice(chains)
            cut = r.randint(1, len(chain))
            if r.random() < 0.7:
                for ix in (big, small):
                    ix.store(i, chain[:cut])
            else:
                for ix in (big, small):
                    ix.add_pending(i, chain[:cut])
        keys = r.choice(chains)[: r.randint(1, 40)]
        mask = sum(1 << i for i in r.sample(ids, max(1, len(ids) // 2)))
        pmask = sum(1 << i for i in ids) if r.random() < 0.7 else None
        got = big.match_lengths(keys, mask, pmask)
        want = small.match_lengths(keys, mask, pmask)
        n = len(want[0])
        assert got[0][:n].tolist() == want[0].tolist() and not got[0][n:].any()
        assert got[1][:n].tolist() == want[1].tolist() and not got[1][n:].any()
        assert got[2:] == want[2:]
