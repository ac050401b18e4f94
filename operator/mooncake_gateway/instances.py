"""One engine endpoint as a model's runtime tracks it: its membership flags (listed,
healthy, registered, routable), its in-flight count, its KV-event subscription and what
its last ``/metrics`` scrape said."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import Gauge

from .events import EngineSubscriber
from .settings import Endpoint, Role


@dataclass(slots=True)
class EngineStats:
    """What the last ``/metrics`` scrape said (vLLM names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    scraped_at: float = 0.0


@dataclass(slots=True)
class Instance:
    role: Role
    iid: int
    endpoint: Endpoint
    listed: bool = True  # present in the latest endpoint list
    healthy: bool = False  # a health check passed since it joined, and it is not down
    down: bool = False  # marked down by failed checks (a passing check: it came back)
    synced: bool = False  # KV events subscribed and replayed (True without KV events)
    registered: bool = False  # healthy and synced once since it joined or came back
    routable: bool = False  # requests may go there (kept by Membership.refresh)
    failures: int = 0
    inflight: int = 0
    stats: EngineStats = field(default_factory=EngineStats)
    subscriber: EngineSubscriber | None = None
    task: asyncio.Task[None] | None = None
    inflight_gauge: Gauge | None = None  # its labelled child, looked up once
    #: resolved when the instance is marked down (calls waiting on it give up then)
    _went_down: asyncio.Future[None] | None = None

    def went_down(self) -> asyncio.Future[None]:
        """A future that resolves the next time this instance is marked down."""
        if self._went_down is None or self._went_down.done():
            self._went_down = asyncio.get_running_loop().create_future()
        return self._went_down

    def mark_down(self) -> None:
        self.down = True
        if self._went_down is not None and not self._went_down.done():
            self._went_down.set_result(None)

    @property
    def eligible(self) -> bool:
        """Routable unless revision pairing rules it out."""
        return (self.listed and self.registered and self.healthy
                and not self.endpoint.draining)

    @property
    def name(self) -> str:
        return self.endpoint.label

    @property
    def pod(self) -> str:
        """The pod (namespace/name) when known, else the display name."""
        return self.endpoint.pod or self.endpoint.label
