"""Pod agent: keeps the prefixes a pod is asked to hold warm.

The Conductor asks a pod to hold replicas of hot prefixes by patching the pod
annotation :data:`REPLICA_ANNOTATION`. Kubernetes projects pod annotations into a
file through the downward API (``fieldRef: metadata.annotations``), one
``key="value"`` line per annotation with the value quoted like Go's ``strconv.Quote``.

Annotation value: a JSON array of entries, each naming one prefix::

    [{"prefix": "sys-prompt-7", "tokens": [101, 102, ...]},
     {"prefix": "doc-42", "keys": [12345678901234567890, ...]}]

- ``prefix``: an id (string or int) the Conductor uses to name the replica.
- ``tokens``: the prefix's token ids; the agent derives the block keys itself
  (full blocks only).
- ``keys``: the prefix's block keys (``mooncake_conductor.blockkeys``); usable only
  when the blocks are in the Mooncake Store (their payload carries the tokens).

For every entry the agent loads the blocks from the Mooncake Store when configured,
computes the rest with a prefill (with its modelled time), and pins the blocks in the
cache while the entry is listed; BlockStored events announce them. When an entry
disappears its blocks are unpinned and age out by LRU. ``GET /agent/state`` reports
what is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from mooncake_contract.annotations import (
    REPLICA_ANNOTATION,
    ReplicaSpec,
    parse_annotations,
    parse_replicas,
)

from .engine import Engine, QueueFull, TooLarge
from .kvcache import Block
from .store import BlockStore

log = logging.getLogger(__name__)

@dataclass
class Replica:
    spec: ReplicaSpec
    keys: list[int]
    state: str = "pending"  # pending | warming | ready | partial | failed
    source: str = ""
    pinned: list[Block] = field(default_factory=list)
    error: str | None = None
    warmed_at: float = 0.0

    def report(self, held: int) -> dict[str, Any]:
        return {
            "prefix": self.spec.prefix,
            "blocks": len(self.keys),
            "held_blocks": held,
            "state": self.state,
            "source": self.source,
            "error": self.error,
        }


class AgentBase:
    """Annotation polling and replica bookkeeping; subclasses warm and release."""

    def __init__(self, path: str, poll_s: float) -> None:
        self.path = path
        self.poll_s = poll_s
        self.replicas: dict[str, Replica] = {}
        self.generation = 0
        self.last_error: str | None = None
        self._mtime: int | None = None
        self._task: asyncio.Task[None] | None = None

    # -- to implement ---------------------------------------------------------------------
    def keys_of(self, tokens: list[int]) -> list[int]:
        raise NotImplementedError

    async def _warm(self, r: Replica) -> None:
        raise NotImplementedError

    def _release(self, r: Replica) -> None:
        """The entry is gone: let its blocks age out."""

    def held(self, r: Replica) -> int:
        return len(r.pinned)

    async def tick(self) -> None:
        """Called after every poll (e.g. to re-warm evicted prefixes)."""

    # -- common ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pod-agent")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def state(self) -> dict[str, Any]:
        reports = [r.report(self.held(r)) for r in self.replicas.values()]
        return {
            "annotation": REPLICA_ANNOTATION,
            "file": self.path,
            "generation": self.generation,
            "last_error": self.last_error,
            "replicas": reports,
            "held_blocks": sum(x["held_blocks"] for x in reports),
        }

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep polling whatever the file holds
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("pod agent poll failed")
            await asyncio.sleep(self.poll_s)

    async def poll_once(self) -> bool:
        """Re-read the file if its mtime changed; returns whether it was applied."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            mtime = None
        else:
            mtime = st.st_mtime_ns
        if mtime == self._mtime and self.generation > 0:
            return False
        self._mtime = mtime
        text = ""
        if mtime is not None:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        value = parse_annotations(text).get(REPLICA_ANNOTATION, "[]")
        try:
            specs = parse_replicas(value)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self.last_error = f"bad {REPLICA_ANNOTATION}: {exc}"
            self.generation += 1
            return False
        self.last_error = None
        await self.apply(specs)
        self.generation += 1
        return True

    async def apply(self, specs: list[ReplicaSpec]) -> None:
        wanted = {s.prefix: s for s in specs}
        for pid in list(self.replicas):
            r = self.replicas[pid]
            if pid not in wanted or wanted[pid] != r.spec:
                self._release(r)
                del self.replicas[pid]
        for pid, spec in wanted.items():
            if pid not in self.replicas:
                keys = spec.keys if spec.keys is not None else self.keys_of(spec.tokens or [])
                self.replicas[pid] = Replica(spec, keys)
        await asyncio.gather(
            *(self._warm(r) for r in self.replicas.values() if r.state == "pending")
        )


class PodAgent(AgentBase):
    """The agent of a simulated engine: loads from the store, computes, pins."""

    def __init__(self, engine: Engine, path: str, poll_s: float,
                 store: BlockStore | None = None) -> None:
        super().__init__(path, poll_s)
        self.engine = engine
        self.store = store

    def keys_of(self, tokens: list[int]) -> list[int]:
        return self.engine.keys_of(tokens)

    def _release(self, r: Replica) -> None:
        self.engine.unpin(r.pinned)
        r.pinned = []

    async def _warm(self, r: Replica) -> None:
        r.state = "warming"
        eng = self.engine
        keys = r.keys
        bs = eng.block_size
        sources: list[str] = []
        have = eng.cache.match(keys)
        if have:
            sources.append("cache")
        if have < len(keys) and self.store is not None:
            got = await self.store.get_blocks(keys[have:])
            toks: list[list[int]] = []
            for g in got:
                if g is None or len(g[1]) != bs:
                    break
                if r.spec.tokens is not None:
                    i = have + len(toks)
                    if g[1] != r.spec.tokens[i * bs : (i + 1) * bs]:
                        break
                toks.append(g[1])
            if toks:
                parent = keys[have - 1] if have else None
                n = eng.insert_blocks(keys[have : have + len(toks)], parent, toks)
                t = eng.cost.transfer_time(n * bs) * eng.settings.time_scale
                if t > 0:
                    await asyncio.sleep(t)
                sources.append("store")
                have = eng.cache.match(keys)
        tokens = r.spec.tokens
        if have < len(keys) and tokens is not None:
            prompt = tokens[: len(keys) * bs]
            try:
                seq = eng.submit(prompt, 0, keys=keys)
            except (QueueFull, TooLarge) as exc:
                r.state, r.error = "failed", str(exc)
                return
            assert seq.done is not None
            await seq.done
            sources.append("compute")
            if self.store is not None:
                await self.store.put_blocks(
                    keys, [prompt[i * bs : (i + 1) * bs] for i in range(len(keys))]
                )
        if self.replicas.get(r.spec.prefix) is not r:
            return  # removed while warming
        r.pinned = eng.pin(keys)
        r.source = "+".join(sources)
        if len(r.pinned) == len(keys):
            r.state = "ready"
        elif r.pinned:
            r.state = "partial"
        else:
            r.state = "failed"
            r.error = "blocks not in the store and no tokens to compute them"
