"""How a prefill's KV cache reaches the decode engine: one handshake per engine connector.

Each handshake names the fields the gateway splices into the prefill body and into the
decode body, and whether the two halves go one after the other or at once. The operator
picks it for a cluster (``ModelSettings.handshake``) from the engine release it runs; the
conformance suite (``tests/conformance``) feeds what each one produces to that engine's
own request classes and connector.

- ``kv-transfer-params``: vLLM's ``MooncakeConnector`` (P2P), and our simulated engine,
  which speaks it. The prefill gets ``{do_remote_decode, do_remote_prefill: false,
  transfer_id}``: vLLM then holds the prompt's blocks for that transfer id and answers
  with no parameters of its own. The decode gets ``{do_remote_prefill, remote_engine_id,
  remote_bootstrap_addr, transfer_id}``: the prefill engine's id (its pod's name, which
  the operator makes its ``engine_id``) and its bootstrap server, where the decode engine
  finds its peer. Source: vLLM 0.33 ``kv_connector/v1/mooncake/mooncake_connector.py``.
- ``store``: vLLM's ``MooncakeStoreConnector``: no fields; the prefill engine saves the
  prompt's blocks in the Mooncake Store and the decode engine looks them up by hash.
- ``bootstrap``: SGLang: both halves get ``bootstrap_host``, ``bootstrap_port`` and one
  random 63-bit ``bootstrap_room`` and go at once (an SGLang prefill engine waits in its
  bootstrap queue until the decode engine of the same room connects). Source: SGLang
  0.5.23 ``entrypoints/openai/protocol.py`` (``PDRoutingFields``), ``disaggregation/``.
"""

from __future__ import annotations

import secrets
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from .settings import Endpoint

Fields = dict[str, Any]
#: bootstrap rooms are non-negative signed 64-bit ints (SGLang parses them as int64)
ROOM_BITS = 63


@dataclass(frozen=True, slots=True)
class Transfer:
    """One request's hand-over: its id, and the prefill engine it comes from."""

    id: str
    room: int
    prefill: Endpoint
    #: the prefill engine's Mooncake bootstrap port (None: the worker's own HTTP port)
    bootstrap_port: int | None

    @classmethod
    def new(cls, prefill: Endpoint, bootstrap_port: int | None) -> Transfer:
        return cls(id=f"xfer-{uuid.uuid4().hex}", room=secrets.randbits(ROOM_BITS),
                   prefill=prefill, bootstrap_port=bootstrap_port)

    @property
    def host(self) -> str:
        return urlsplit(self.prefill.url).hostname or ""

    @property
    def port(self) -> int:
        if self.bootstrap_port is not None:
            return self.bootstrap_port
        return urlsplit(self.prefill.url).port or 80

    @property
    def engine_id(self) -> str:
        """The prefill engine's id: its pod's name (the operator sets vLLM's
        ``engine_id`` to it), else the endpoint's name."""
        return self.prefill.pod.rsplit("/", 1)[-1] if self.prefill.pod else self.prefill.label

    def with_prefill(self, prefill: Endpoint) -> Transfer:
        """The same transfer from another prefill engine (a retry)."""
        return Transfer(self.id, self.room, prefill, self.bootstrap_port)


class Handshake(ABC):
    """The fields of the two halves of a disaggregated request."""

    name: ClassVar[str]
    #: send prefill and decode at once (else the decode waits for the prefill's answer)
    concurrent: ClassVar[bool] = False

    @abstractmethod
    def prefill_fields(self, t: Transfer) -> Fields:
        """Top-level fields to set in the prefill body."""

    @abstractmethod
    def decode_fields(self, t: Transfer) -> Fields:
        """Top-level fields to set in the decode body."""


class KVTransferParams(Handshake):
    name = "kv-transfer-params"

    def prefill_fields(self, t: Transfer) -> Fields:
        return {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "transfer_id": t.id}}

    def decode_fields(self, t: Transfer) -> Fields:
        host = f"[{t.host}]" if ":" in t.host else t.host
        return {"kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": t.engine_id,
            "remote_bootstrap_addr": f"http://{host}:{t.port}",
            "transfer_id": t.id}}


class Store(Handshake):
    name = "store"

    def prefill_fields(self, t: Transfer) -> Fields:
        return {}

    def decode_fields(self, t: Transfer) -> Fields:
        return {}


class Bootstrap(Handshake):
    name = "bootstrap"
    concurrent = True

    def prefill_fields(self, t: Transfer) -> Fields:
        return {"bootstrap_host": t.host, "bootstrap_port": t.port, "bootstrap_room": t.room}

    def decode_fields(self, t: Transfer) -> Fields:
        return self.prefill_fields(t)


HANDSHAKES: dict[str, Handshake] = {h.name: h for h in (KVTransferParams(), Store(),
                                                        Bootstrap())}
DEFAULT = KVTransferParams.name


def handshake(name: str) -> Handshake:
    try:
        return HANDSHAKES[name]
    except KeyError:
        raise ValueError(f"unknown handshake {name!r}; known: {', '.join(HANDSHAKES)}") from None
