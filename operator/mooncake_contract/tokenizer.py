"""A deterministic, dependency-free tokenizer and generator for the simulated engine.

Tokenizing (documented so that any client can reproduce it):

- Text is split by the regex ``\\w+|[^\\w\\s]`` (words and single punctuation marks;
  whitespace is dropped).
- Special markers ``<|start|>``, ``<|end|>`` (used by the chat template) map to the
  reserved ids 3 and 4; ids below :data:`FIRST_WORD_ID` are reserved.
- Every other piece maps to ``FIRST_WORD_ID + crc32(piece.encode()) % (VOCAB_SIZE -
  FIRST_WORD_ID)``.

Chat template: each message renders as ``<|start|>{role}\\n{content}<|end|>\\n``, and
the prompt ends with ``<|start|>assistant\\n`` (the generation prompt).

Generation: the next token is a pure function of the whole context (prompt plus what was
generated so far): a chained 64-bit hash ``h' = (h * P + token + 1) mod 2^64`` over the
context, finalised with SplitMix64, modulo the word range. A decode worker that receives
a prompt therefore continues exactly where a prefill worker (or a single worker) would.
Generated ids detokenize to pronounceable words (base-16 syllables), each prefixed
with a space.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_conductor.blockkeys import MASK64, P, mix64

#: Size of the simulated vocabulary (token ids are ``0 .. VOCAB_SIZE-1``).
VOCAB_SIZE = 131072
START_ID = 3
END_ID = 4
FIRST_WORD_ID = 256
WORD_RANGE = VOCAB_SIZE - FIRST_WORD_ID
SPECIAL = {"<|start|>": START_ID, "<|end|>": END_ID}
_SPLIT = re.compile(r"<\|start\|>|<\|end\|>|\w+|[^\w\s]")
_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "da", "gu", "zo", "be", "fi", "ho", "ju",
)  # fmt: skip
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
GEN_SEED = 0x6D6F6F6E63616B65  # "mooncake"


class Tokenizer:
    """Word-hash tokenizer with a small memo of recently seen pieces."""

    def __init__(self, memo_size: int = 1 << 16) -> None:
        self._memo: dict[str, int] = {}
        self._memo_size = memo_size

    def _piece_id(self, piece: str) -> int:
        tid = self._memo.get(piece)
        if tid is None:
            tid = SPECIAL.get(piece)
            if tid is None:
                tid = FIRST_WORD_ID + zlib.crc32(piece.encode()) % WORD_RANGE
            if len(self._memo) < self._memo_size:
                self._memo[piece] = tid
        return tid

    def encode(self, text: str) -> list[int]:
        pid = self._piece_id
        return [pid(p) for p in _SPLIT.findall(text)]

    @staticmethod
    def render_chat(messages: Sequence[dict[str, Any]]) -> str:
        """The chat template (caller validates the messages' shape)."""
        parts = [
            f"<|start|>{m['role']}\n{message_text(m.get('content'))}<|end|>\n" for m in messages
        ]
        parts.append("<|start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(self.render_chat(messages))

    @staticmethod
    def decode_token(tid: int) -> str:
        """Text of one generated id: a space then its base-16 syllables."""
        text = _WORDS.get(tid)
        if text is None:
            text = _WORDS[tid] = _word(tid)
        return text

    def decode(self, ids: Sequence[int]) -> str:
        get = _WORDS.get
        return "".join(get(t) or self.decode_token(t) for t in ids)


_WORDS: dict[int, str] = {}


def _word(tid: int) -> str:
    if tid < FIRST_WORD_ID:
        return ""
    x = tid - FIRST_WORD_ID
    out = []
    while True:
        out.append(_SYLLABLES[x & 15])
        x >>= 4
        if not x:
            break
    return " " + "".join(out)


def chat_messages_problem(
    messages: Any, part_ok: Callable[[Any], bool], parts_rule: str
) -> str | None:
    """The first thing wrong with a chat request's ``messages``, as a sentence for a 400
    answer (``None``: nothing): a non-empty list of objects with a known ``role`` and
    a ``content`` that is absent, a string, or a list of parts each passing
    ``part_ok`` (``parts_rule`` says what that means)."""
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object"
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            return f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}"
        c = m.get("content")
        if not (c is None or isinstance(c, str)
                or (isinstance(c, list) and all(part_ok(part) for part in c))):
            return f"messages[{i}].content must be {parts_rule}"
    return None


def message_text(content: Any) -> str:
    """Text of a chat message's content: a string, None, or OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return "".join(texts)


def context_state(tokens: Sequence[int], state: int = GEN_SEED) -> int:
    """Fold ``tokens`` into the generator's chained hash state."""
    h = state
    for t in tokens:
        h = (h * P + t + 1) & MASK64
    return h


def next_token(state: int) -> int:
    """The token the simulated model emits after a context with hash ``state``."""
    return FIRST_WORD_ID + mix64(state) % WORD_RANGE


def advance(state: int, token: int) -> int:
    return (state * P + token + 1) & MASK64
