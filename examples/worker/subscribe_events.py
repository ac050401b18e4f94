"""Print a worker's (or a real vLLM's) KV events, recovering gaps through replay.

    python examples/worker/subscribe_events.py tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import asyncio

from mooncake_contract.kvevents import KVEventBatch
from mooncake_contract.kvevents.codec import to_plain
from mooncake_contract.kvevents.subscriber import KVEventSubscriber


def show(seq: int, batch: KVEventBatch) -> None:
    print(seq, to_plain(batch))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--replay", default=None)
    ap.add_argument("--from-start", action="store_true",
                    help="replay everything the publisher still buffers")
    args = ap.parse_args()
    sub = KVEventSubscriber(args.endpoint, show, replay_endpoint=args.replay,
                            expected_seq=0 if args.from_start else None)
    await sub.run()


if __name__ == "__main__":
    asyncio.run(main())
