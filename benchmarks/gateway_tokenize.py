"""Tokenizing a long multi-turn conversation: uncached vs the gateway's caches.

    python benchmarks/gateway_tokenize.py [--turns 40] [--words-per-turn 2500]

Each turn appends a user message and an answer; the gateway re-tokenizes the whole
conversation on every request. Reported: the worker's tokenizer on the whole prompt
(what a router without a cache pays) and the gateway's cached path, for the last turn.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from mooncake_contract.tokenizer import Tokenizer
from mooncake_gateway.tokens import PromptTokenizer

MS = 1000.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--words-per-turn", type=int, default=2500)
    a = ap.parse_args()
    asyncio.run(_run(a))
    return 0


async def _run(a: argparse.Namespace) -> None:
    rng = random.Random(0)
    convo: list[dict[str, Any]] = [{"role": "system", "content": "You are concise."}]
    gw = PromptTokenizer(4096)
    plain = Tokenizer(memo_size=0)
    cold = warm = 0.0
    n = 0
    for turn in range(a.turns):
        text = " ".join(f"w{rng.randrange(50000)}" for _ in range(a.words_per_turn))
        convo.append({"role": "user", "content": text + "?"})
        t0 = time.perf_counter()
        ref = plain.encode_chat(convo)
        t1 = time.perf_counter()
        got = await gw.chat(convo)
        t2 = time.perf_counter()
        assert got.tolist() == ref
        cold, warm, n = t1 - t0, t2 - t1, len(ref)
        convo.append({"role": "assistant", "content": f"answer {turn}"})
    print(f"last turn: {n:,} tokens; uncached {cold * MS:.1f} ms, gateway cache "
          f"{warm * MS:.2f} ms ({cold / warm:.0f}x)")


if __name__ == "__main__":
    sys.exit(main())
