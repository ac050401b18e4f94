"""A small Dockerfile reader for the image tests: instructions with their stage."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ("operator", "worker")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # continuation lines joined, comments dropped
    stage: int  # 0-based index of the FROM it belongs to
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON (exec) form of ENTRYPOINT/CMD/RUN, or None for the shell form."""
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        return None

    def flags(self) -> dict[str, str]:
        """``--from=builder`` style flags at the start of the arguments."""
        out: dict[str, str] = {}
        for word in self.args.split():
            if not word.startswith("--"):
                break
            key, _, value = word[2:].partition("=")
            out[key] = value
        return out

    def words(self) -> list[str]:
        """The arguments after the flags."""
        words = self.args.split()
        while words and words[0].startswith("--"):
            words.pop(0)
        return words


def dockerfile(image: str) -> Path:
    return ROOT / "images" / image / "Dockerfile"


def parse(path: Path) -> list[Instruction]:
    out: list[Instruction] = []
    stage = -1
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments (also inside continuations, as Docker drops them)
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), stage, start))
    assert not pending, f"{path}: ends inside a continuation"
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]
