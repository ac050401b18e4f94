"""Pod agent: annotation file parsing, warming by compute and from Mooncake Store, pinning,
and ageing out after removal."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mooncake_conductor.blockkeys import block_keys, namespace_seed
from mooncake_contract.annotations import REPLICA_ANNOTATION, go_quote
from worker_fixtures import Master, WorkerProc, run_worker

MODEL = "llama3-70b-sim"
SEED = namespace_seed(MODEL, 16)


def write_annotations(path: Path, replicas: list[dict[str, Any]] | None) -> None:
    lines = ['kubernetes.io/config.seen="2026-01-01T00:00:00Z"']
    if replicas is not None:
        lines.append(f"{REPLICA_ANNOTATION}={go_quote(json.dumps(replicas))}")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(sorted(lines)) + "\n")
    os.replace(tmp, path)  # kubelet swaps the file atomically too


def wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    assert cond()


def held(w: WorkerProc) -> set[int]:
    return set(w.get("/kv/blocks")["keys"])


def state(w: WorkerProc) -> dict[str, Any]:
    return w.get("/agent/state")


def test_agent_warms_pins_and_releases(tmp_path: Path) -> None:
    ann = tmp_path / "annotations"
    tokens = list(range(1000, 1000 + 160))  # 10 blocks
    keys = block_keys(tokens, 16, SEED)
    write_annotations(ann, [{"prefix": "sys-a", "tokens": tokens}])
    # tiny cache (16 blocks) so that unpinned blocks age out quickly
    with run_worker("--time-scale", "0", "--cache-tokens", "256", "--annotations-file", str(ann),
                    "--agent-poll", "0.05") as w:
        wait(lambda: any(r["state"] == "ready" for r in state(w)["replicas"]))
        st = state(w)
        assert st["annotation"] == REPLICA_ANNOTATION
        assert st["replicas"][0]["held_blocks"] == 10 and st["replicas"][0]["source"] == "compute"
        assert set(keys) <= held(w)
        # pinned: traffic that needs the rest of the cache cannot evict them
        for i in range(4):
            code, _ = w.post("/v1/completions", {"prompt": [5000 + i] * 90, "max_tokens": 1})
            assert code == 200
        assert set(keys) <= held(w)
        # removed from the annotation: unpinned, then aged out by LRU
        write_annotations(ann, [])
        wait(lambda: state(w)["replicas"] == [])
        assert w.get("/kv/blocks")["used_blocks"] == 0
        for i in range(4):
            w.post("/v1/completions", {"prompt": [6000 + i] * 90, "max_tokens": 1})
        assert not set(keys) & held(w)


def test_agent_bad_annotation_is_reported(tmp_path: Path) -> None:
    ann = tmp_path / "annotations"
    ann.write_text(f'{REPLICA_ANNOTATION}="not json"\n')
    with run_worker("--time-scale", "0", "--annotations-file", str(ann),
                    "--agent-poll", "0.05") as w:
        wait(lambda: state(w)["last_error"] is not None)
        assert state(w)["replicas"] == []
        code, _ = w.post("/v1/completions", {"prompt": "still serving", "max_tokens": 1})
        assert code == 200


@pytest.mark.store
def test_agent_warms_from_store_by_keys(tmp_path: Path, mooncake_master: Master) -> None:
    store = ("--store", mooncake_master.rpc, "--store-metadata", mooncake_master.metadata)
    tokens = list(range(2000, 2000 + 96))  # 6 blocks
    keys = block_keys(tokens, 16, SEED)
    with run_worker("--time-scale", "0", *store) as src:
        # a prefill half on the source worker puts the blocks in the store
        code, body = src.post("/v1/completions", {
            "prompt": tokens, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "x-1"},
        })
        assert code == 200 and body["kv_transfer_params"] is None
        ann = tmp_path / "annotations"
        write_annotations(ann, [{"prefix": "doc-1", "keys": keys}])
        with run_worker("--time-scale", "0", "--annotations-file", str(ann),
                        "--agent-poll", "0.05", *store) as w:
            wait(lambda: any(r["state"] == "ready" for r in state(w)["replicas"]))
            assert state(w)["replicas"][0]["source"] == "store"
            assert set(keys) <= held(w)
            code, body = w.post("/v1/completions", {"prompt": tokens, "max_tokens": 1})
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 95
