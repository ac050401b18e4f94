"""Prompt → token ids, with caches so long multi-turn prompts are not re-tokenized.

- ``local`` mode uses the worker's deterministic tokenizer in-process. The chat
  template renders each message as ``<|start|>{role}\\n{content}<|end|>\\n``; every
  rendered message ends in whitespace, which no token spans, so the tokens of a
  conversation are the concatenation of each message's tokens. Each message is
  tokenized once and cached (LRU, by role and text): turn ``n+1`` of a conversation
  only tokenizes its new messages. String prompts are cut into chunks of about
  :data:`CHUNK_CHARS` characters, each ending just before a whitespace character
  (boundaries depend only on the text before them), and each chunk is cached: a prompt
  that extends an earlier one (multi-turn over ``/v1/completions``) only tokenizes its
  new chunks.
- ``engine`` mode asks an engine's ``/tokenize`` (vLLM's API), caching whole prompts;
  use it for engines whose tokenizer the gateway does not have.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from mooncake_contract.tokenizer import Tokenizer, message_text

Tokens = npt.NDArray[np.int64]

ASSISTANT_PROMPT = "<|start|>assistant\n"
#: target length of a cached piece of a string prompt
CHUNK_CHARS = 2048
_SPACE = re.compile(r"\s")


class LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[Any, Tokens] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Tokens | None:
        v = self._d.get(key)
        if v is None:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return v

    def put(self, key: Any, value: Tokens) -> None:
        if self.size <= 0:
            return
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


def _digest(obj: Any) -> bytes:
    return hashlib.blake2b(
        json.dumps(obj, sort_keys=True, separators=(",", ":")).encode(), digest_size=16
    ).digest()


RemoteTokenize = Callable[[dict[str, Any]], Awaitable[list[int]]]


class PromptTokenizer:
    def __init__(self, cache_entries: int, remote: RemoteTokenize | None = None) -> None:
        self.local = Tokenizer()
        self.cache = LRU(cache_entries)
        self.remote = remote
        self._assistant = _arr(self.local.encode(ASSISTANT_PROMPT))

    async def prompt(self, text: str) -> Tokens:
        if self.remote is not None:
            key: tuple[Any, ...] = ("p", text)
            got = self.cache.get(key)
            if got is None:
                got = _arr(await self.remote({"prompt": text}))
                self.cache.put(key, got)
            return got
        parts: list[Tokens] = []
        for chunk in chunks(text):
            key = ("p", chunk)
            toks = self.cache.get(key)
            if toks is None:
                toks = _arr(self.local.encode(chunk))
                self.cache.put(key, toks)
            parts.append(toks)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def chat(self, messages: Sequence[dict[str, Any]]) -> Tokens:
        if self.remote is not None:
            key: tuple[Any, ...] = ("c", _digest(list(messages)))
            got = self.cache.get(key)
            if got is None:
                got = _arr(await self.remote({"messages": list(messages)}))
                self.cache.put(key, got)
            return got
        parts: list[Tokens] = []
        for m in messages:
            text = message_text(m.get("content"))
            key = ("m", m["role"], text)
            toks = self.cache.get(key)
            if toks is None:
                toks = _arr(self.local.encode(f"<|start|>{m['role']}\n{text}<|end|>\n"))
                self.cache.put(key, toks)
            parts.append(toks)
        parts.append(self._assistant)
        return np.concatenate(parts)


def _arr(tokens: list[int]) -> Tokens:
    return np.asarray(tokens, dtype=np.int64)


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut before a whitespace character about every ``size`` characters (no token
    spans whitespace, so tokenizing the pieces equals tokenizing the whole)."""
    out: list[str] = []
    start = 0
    n = len(text)
    while n - start > size:
        m = _SPACE.search(text, start + size)
        if m is None:
            break
        out.append(text[start : m.start()])
        start = m.start()
    out.append(text[start:])
    return out
