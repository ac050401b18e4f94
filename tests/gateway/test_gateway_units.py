"""Pure parts: the index feeder (own keys from events), tokenizer cache, pod endpoints."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from mooncake_conductor.blockkeys import block_keys, mix64, namespace_seed
from mooncake_conductor.index import PrefixIndex
from mooncake_contract.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from mooncake_contract.tokenizer import Tokenizer
from mooncake_gateway.discovery import pod_endpoint
from mooncake_gateway.kvindex import IndexFeeder, unmix64
from mooncake_gateway.settings import GatewaySettings, KubernetesSource
from mooncake_gateway.tokens import PromptTokenizer

BS = 16
SEED = namespace_seed("m", BS)


def test_unmix64_inverts_mix64() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        x = rng.getrandbits(64)
        assert unmix64(mix64(x)) == x


def _feeder() -> IndexFeeder:
    return IndexFeeder(PrefixIndex(1 << 16), BS, SEED)


def test_feeder_computes_own_keys_from_tokens_and_engine_hashes() -> None:
    rng = random.Random(2)
    tokens = [rng.randrange(256, 131072) for _ in range(5 * BS)]
    ours = block_keys(tokens, BS, SEED)
    engine = [rng.getrandbits(64) for _ in ours]  # an engine's own, unrelated hashes
    f = _feeder()
    # the first two blocks, then the next three chained to the second by the engine's hash
    f.apply(0, 0, KVEventBatch(0.0, [BlockStored(engine[:2], None, tokens[: 2 * BS], BS)]))
    f.apply(0, 1, KVEventBatch(0.0, [BlockStored(engine[2:], engine[1], tokens[2 * BS:], BS)]))
    assert f.index.match(0, ours) == 5
    f.apply(0, 2, KVEventBatch(0.0, [BlockRemoved(engine[3:])]))
    assert f.index.match(0, ours) == 3
    assert f.index.size(0) == 3
    f.apply(0, 3, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert f.index.size(0) == 0


def test_feeder_skips_orphans_and_other_block_sizes() -> None:
    tokens = list(range(300, 300 + 2 * BS))
    f = _feeder()
    f.apply(1, 0, KVEventBatch(0.0, [BlockStored([7, 8], 999, tokens, BS)]))
    assert f.index.size(1) == 0 and f.feeds[1].orphans == 2
    f.apply(1, 1, KVEventBatch(0.0, [BlockStored([7], None, tokens[:32], 32)]))
    assert f.feeds[1].mismatched_block_size == 1


def test_chat_tokens_equal_the_workers_and_are_cached() -> None:
    t = PromptTokenizer(64)
    ref = Tokenizer()
    convo: list[dict[str, Any]] = [{"role": "system", "content": "Be <| brief."}]
    for turn in range(5):
        convo.append({"role": "user", "content": f"question {turn}, please!"})
        assert asyncio.run(t.chat(convo)).tolist() == ref.encode_chat(convo)
        convo.append({"role": "assistant", "content": [{"type": "text", "text": f"a{turn}"}]})
    # each message was tokenized once: later turns hit the cache for the history
    assert t.cache.hits >= 10
    assert t.cache.misses == 1 + 5 + 4  # system, 5 user turns, 4 answers seen again


def _pod(ip: str | None = "10.0.0.7", phase: str = "Running", ready: str = "True",
         ann: dict[str, str] | None = None, name: str = "p-0") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "annotations": ann or {},
                         "labels": {"r": "p"}},
            "status": {"podIP": ip, "phase": phase,
                       "conditions": [{"type": "Ready", "status": ready}]}}


def test_pod_endpoints_from_ip_and_annotations() -> None:
    cfg = KubernetesSource(prefill_selector="role=prefill", decode_selector="role=decode")
    ep = pod_endpoint(_pod(ann={"mooncake.io/http-port": "9000",
                                "mooncake.io/kv-events-port": "6000"}), cfg)
    assert ep is not None
    assert ep.url == "http://10.0.0.7:9000"
    assert ep.kv_events == "tcp://10.0.0.7:6000"
    assert ep.kv_replay == "tcp://10.0.0.7:5558"
    assert ep.name == "ns/p-0"
    assert pod_endpoint(_pod(ready="False"), cfg) is None
    assert pod_endpoint(_pod(ip=None), cfg) is None
    assert pod_endpoint(_pod(phase="Pending"), cfg) is None


def test_settings_apply_gateway_defaults_to_the_conductor_policy() -> None:
    s = GatewaySettings(models=[{"name": "m", "conductor": {"params": {"tie_tolerance": 0.1}}}])
    params = s.models[0].conductor.params
    assert params["cpp"] == {"enabled": False}
    assert params["tie_tolerance"] == 0.1


def test_kubernetes_source_lists_then_follows_the_watch() -> None:
    from mooncake_gateway.discovery import KubernetesPodSource
    from mooncake_gateway.settings import Role

    from ..fake_kube import fake_kube

    cfg = KubernetesSource(prefill_selector="r=p", decode_selector="r=p", namespace="ns")
    seen: dict[Role, list[list[str]]] = {Role.PREFILL: [], Role.DECODE: []}
    with fake_kube() as k:
        k.put("pods", _pod("10.0.0.1", name="a"))
        k.put("pods", {**_pod("10.0.0.9", name="z"), "metadata": {"name": "z",
                                                                  "namespace": "ns"}})
        src = KubernetesPodSource(cfg, k.client())

        async def run() -> None:
            await src.start(lambda role, eps: seen[role].append([e.url for e in eps]))
            for _ in range(100):
                if seen[Role.PREFILL] and seen[Role.DECODE]:
                    break
                await asyncio.sleep(0.02)
            await asyncio.to_thread(k.put, "pods", _pod("10.0.0.2", name="b"))
            await asyncio.to_thread(k.delete, "pods", "ns", "a")
            for _ in range(100):
                if len(seen[Role.PREFILL]) >= 3 and len(seen[Role.DECODE]) >= 3:
                    break
                await asyncio.sleep(0.02)
            await src.stop()

        asyncio.run(run())
    for role in Role:  # z is not selected
        assert seen[role][:3] == [["http://10.0.0.1:8000"],
                                  ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                                  ["http://10.0.0.2:8000"]]


def test_long_string_prompts_are_tokenized_in_cached_chunks() -> None:
    rng = random.Random(3)
    words = ["alpha", "b<|", "<|end|>", "x.y", "日本", "don't", "\n", "  "]
    text = " ".join(rng.choice(words) + str(rng.randrange(50)) for _ in range(3000))
    t = PromptTokenizer(256)
    assert asyncio.run(t.prompt(text)).tolist() == Tokenizer().encode(text)
    misses = t.cache.misses
    longer = text + " and one more turn, please."
    assert asyncio.run(t.prompt(longer)).tolist() == Tokenizer().encode(longer)
    assert t.cache.misses - misses == 1  # only the last chunk is new


def test_subscriber_drops_duplicates_resets_on_restart_and_resyncs_on_loss() -> None:
    from mooncake_contract.kvevents import encode_batch, encode_seq
    from mooncake_gateway.events import EngineSubscriber

    calls: list[str] = []
    got: list[int] = []
    sub = EngineSubscriber("tcp://127.0.0.1:1", lambda seq, _b: got.append(seq), None, b"",
                           0.1, on_reset=lambda: calls.append("reset"),
                           on_lost=lambda: calls.append("lost"))
    a = encode_batch(KVEventBatch(1.0, [AllBlocksCleared()]))
    b = encode_batch(KVEventBatch(2.0, [AllBlocksCleared()]))

    async def run() -> None:
        await sub.handle([b"", encode_seq(0), a])
        await sub.handle([b"", encode_seq(0), a])  # a live copy of a replayed batch
        assert (got, calls, sub.duplicates) == ([0], [], 1)
        await sub.handle([b"", encode_seq(0), b])  # seq went back: the engine restarted
        assert calls == ["reset"] and got == [0, 0]
        await sub.handle([b"", encode_seq(5), a])  # 1..4 missing, nothing to replay from
        assert calls == ["reset", "lost"] and got[-1] == 5 and sub.lost == 4

    asyncio.run(run())


def test_gc_freeze_at_startup_and_unfreeze_at_cleanup() -> None:
    """Start-up objects go to the collector's permanent generation once serving, and
    come back when the gateway stops."""
    import gc

    from aiohttp.test_utils import TestServer
    from mooncake_gateway.server import Gateway
    from mooncake_gateway.settings import GatewaySettings

    async def run(freeze: bool) -> tuple[int, int]:
        gw = Gateway(GatewaySettings(
            models=[{"name": "m", "prefill": [{"url": "http://127.0.0.1:9"}],
                     "decode": [{"url": "http://127.0.0.1:9"}]}],
            warm_kernels=False, gc_freeze=freeze))
        server = TestServer(gw.app, host="127.0.0.1")
        await server.start_server()
        frozen = gc.get_freeze_count()
        await server.close()
        return frozen, gc.get_freeze_count()

    gc.unfreeze()
    assert asyncio.run(run(False)) == (0, 0)
    frozen, after = asyncio.run(run(True))
    assert frozen > 10_000 and after == 0
