"""What every probe shares: its wire protocol with the test, a staged pod, a tiny model.

Runs inside an engine's virtual environment, which holds the engine and its dependencies
and nothing of ours: the standard library, the engine and what it pulls in only.

Protocol: ``python <probe>.py <command>``; the request is one JSON document on stdin
(live commands then read one command word per line). The probe writes JSON lines to its
real stdout; the engines' own logging is sent to stderr, so a library that prints cannot
corrupt the answer. The last line is the result; a failure is ``{"ok": false, "stage":
..., "error": ...}`` naming where it happened.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

#: the probe's answers; fd 1 itself goes to stderr (engines log to stdout)
_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_BASE_ENV = dict(os.environ)
#: the tiny model's shape: attention heads divisible by every tensor-parallel size the
#: operator asks for (1, 2, 4, 8), so the engines' own TP checks pass
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
        "max_position_embeddings": 131072}


class Failed(Exception):
    """A check the probe could not get through: ``stage`` names which."""

    def __init__(self, stage: str, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.stage = stage


def say(obj: dict[str, Any]) -> None:
    _OUT.write(json.dumps(obj, default=_jsonable) + "\n")
    _OUT.flush()


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):
        return {"bin": bytes(v).hex()}
    if isinstance(v, set | frozenset | tuple):
        return list(v)
    return repr(v)


def plain(v: Any) -> Any:
    """JSON-safe form of decoded msgpack: bytes as ``{"bin": hex}``, tuples as lists."""
    if isinstance(v, bytes | bytearray):
        return {"bin": bytes(v).hex()}
    if isinstance(v, list | tuple):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    return v


def stage(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except SystemExit as exc:  # argparse refusing an argument exits
        raise Failed(name, RuntimeError(f"exited with {exc.code}")) from exc
    except Exception as exc:
        traceback.print_exc()
        raise Failed(name, exc) from exc


def main(commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        say({"ok": False, "stage": "usage", "error": f"commands: {sorted(commands)}"})
        sys.exit(2)
    request = json.loads(sys.stdin.readline())
    try:
        result = commands[sys.argv[1]](request)
    except Failed as exc:
        say({"ok": False, "stage": exc.stage, "error": str(exc)})
        return
    say({"ok": True, **result})


def command() -> str:
    """The next command word of a live probe (``""`` at end of input)."""
    return sys.stdin.readline().strip()


def publish_on_command(publisher: Any, batches: list[Any], ready: dict[str, Any]
                       ) -> dict[str, Any]:
    """Serve a live publisher: say it is ready (with the TCP sockets this process listens
    on), then ``publish N`` sends the next N batches and ``stop`` ends. The result: what
    was sent, as msgpack decodes it (after the publisher filled in the ranks)."""
    import msgspec

    say({"event": "ready", **ready, "batches": len(batches),
         "listening": listening(os.getpid())})
    sent = 0
    while (word := command()).startswith("publish"):
        n = int(word.split()[1])
        for b in batches[sent:sent + n]:
            publisher.publish(b)  # fills the batch's rank where it is None
        sent += n
        say({"event": "published", "count": sent})
    publisher.shutdown()
    encoder = msgspec.msgpack.Encoder()
    return {"sent": [plain(msgspec.msgpack.decode(encoder.encode(b))) for b in batches[:sent]]}


class Pod:
    """A pod's engine container as the kubelet would start it here: its arguments (after
    the command) and environment with every ``$(VAR)`` expanded and every mount moved to a
    local folder, which the test staged (``mooncake_conformance.pods``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.args: list[str] = list(spec["args"])
        self.env: dict[str, str] = dict(spec["env"])

    def apply_env(self) -> None:
        """This pod's environment, and nothing of the last one's."""
        os.environ.clear()
        os.environ.update(_BASE_ENV)
        os.environ.update(self.env)


def each_pod(req: dict[str, Any], check: Callable[[Pod], dict[str, Any]]) -> dict[str, Any]:
    """``check`` on every pod of ``req["pods"]`` in this one process (an engine's import
    is the slow part); a refusal is that pod's result, not the run's."""
    results = []
    for spec in req["pods"]:
        pod = Pod(spec)
        try:
            results.append({"ok": True, **check(pod)})
        except Failed as exc:
            results.append({"ok": False, "stage": exc.stage, "error": str(exc)})
    return {"results": results}


def tiny_model(with_tokenizer: bool = True, weights: bool = False,
               out: str | None = None) -> str:
    """A tiny Llama made here (nothing downloaded): ``config.json`` and, if asked, a
    word-level tokenizer and random weights (seeded: every run makes the same model; only
    a real engine run on a GPU needs them)."""
    from transformers import LlamaConfig

    out = out or tempfile.mkdtemp(prefix="tiny-llama-")
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
                      pad_token_id=3, tie_word_embeddings=False, torch_dtype="bfloat16",
                      **TINY)
    cfg.save_pretrained(out)
    if weights:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if with_tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        specials = ["<unk>", "<s>", "</s>", "<pad>"]
        words = [f"w{i}" for i in range(TINY["vocab_size"] - len(specials))]
        vocab = {t: i for i, t in enumerate(specials + words)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>", pad_token="<pad>").save_pretrained(out)
    return out


def listening(pid: int) -> list[dict[str, Any]]:
    """Every TCP socket ``pid`` listens on (from /proc: no tool needed)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = []
    for table, family in (("tcp", 4), ("tcp6", 6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            out.append({"family": family, "address": _address(addr_hex, family),
                        "port": int(port_hex, 16)})
    return out


def _address(hex_addr: str, family: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if family == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
    return str(ipaddress.IPv6Address(b"".join(words)))
