"""KV events from the engines' own publishers, made from the generated pods' own
``--kv-events-config``, read by our subscriber exactly as the worker beside the engine
reads them (its ``--engine-kv-events`` and ``--engine-kv-replay``).

The engine's probe publishes batches built with the engine's own event classes, in every
shape their annotations allow (hashes as unsigned, signed and raw-digest values, parents
absent and present, every medium, LoRA and session fields, per-block extra keys and
lookahead tokens, an empty batch, ranks set and left to the publisher). Our subscriber
joins after the first batches went out, so it must fetch them through the replay
socket's protocol; then every batch must decode to exactly what was sent, with nothing
dropped, skipped or lost. The publisher must listen on no TCP address at all.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from mooncake_conductor.index import TIER_BY_MEDIUM
from mooncake_conformance.runner import LiveProbe, probe_script
from mooncake_contract.kvevents.codec import KVEventBatch, to_plain
from mooncake_contract.kvevents.subscriber import KVEventSubscriber
from mooncake_operator.engines import EngineRelease

from .conftest import installed
from .matrix import Case

#: batches published before the subscriber joins (it must replay them)
EARLY = 2
JOIN_S = 1.0  # ample for IPC on a loaded host (propagation is milliseconds)
WAIT_S = 20.0


def _normal(v: Any) -> Any:
    """One form for both sides: bytes as hex, tuples as lists, absent and None alike."""
    if isinstance(v, bytes | bytearray):
        return {"bin": bytes(v).hex()}
    if isinstance(v, dict):
        return {k: _normal(x) for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        return [_normal(x) for x in v]
    return v


async def _read_all(sub: KVEventSubscriber, got: list[tuple[int, KVEventBatch]],
                    total: int) -> None:
    task = asyncio.create_task(sub.run())
    try:
        deadline = time.monotonic() + WAIT_S
        while len(got) < total and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_engine_publisher_to_our_subscriber(release: EngineRelease) -> None:
    env = installed(release)
    case = Case(release, store=False, protocol="tcp", block_size=16, tp=1, role="prefill")
    built = case.build()
    args = built.worker.args
    endpoint = args[args.index("--engine-kv-events") + 1]
    replay = args[args.index("--engine-kv-replay") + 1]
    probe = LiveProbe(env, "events", {"pod": built.engine.probe_pod()})
    got: list[tuple[int, KVEventBatch]] = []
    try:
        ready = probe.read()
        # every storage tier the engine names is one the index files deliberately
        assert ready["media"] and set(ready["media"]) <= set(TIER_BY_MEDIUM), ready["media"]
        assert (ready["endpoint"], ready["replay_endpoint"]) == (endpoint, replay)
        assert ready["listening"] == [], "the engine's KV events listen on TCP"
        total = int(ready["batches"])
        probe.send(f"publish {EARLY}")
        assert probe.read()["count"] == EARLY
        sub = KVEventSubscriber(endpoint, lambda seq, b: got.append((seq, b)),
                                replay_endpoint=replay, expected_seq=0,
                                topic=ready["topic"].encode())

        async def scenario() -> None:
            sub.connect()
            await asyncio.sleep(JOIN_S)  # the subscription reaches the publisher
            probe.send(f"publish {total - EARLY}")
            await _read_all(sub, got, total)

        asyncio.run(scenario())
        assert probe.read()["count"] == total
        sent = probe.finish()["sent"]
    finally:
        probe.close()
    assert [seq for seq, _ in got] == list(range(total))
    assert (sub.bad, sub.lost, sub.unknown_events, sub.errors) == (0, 0, 0, 0)
    assert sub.replayed >= EARLY  # the early batches came through the replay socket
    for (seq, batch), want in zip(got, sent, strict=True):
        assert _normal(to_plain(batch)) == _normal(want), f"batch {seq} differs"


@pytest.mark.parametrize("field", ["lookahead_token_ids", "extra_keys"])
def test_every_field_shape_is_covered(field: str) -> None:
    """The vLLM probe's batches carry vLLM's list-shaped fields in several shapes (a guard
    on the probe: coverage that silently shrank would make the test above pass on less)."""
    text = probe_script("vllm").read_text()
    assert text.count(f"{field}=") >= 3
