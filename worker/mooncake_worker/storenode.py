"""``mooncake-operator store-node``: lend a node's memory to the Mooncake Store.

What the store DaemonSet runs on every GPU node: a real Mooncake Store client
(``MooncakeDistributedStore`` from the PyPI wheel) that mounts ``--segment-bytes`` of this
node's memory into the store's global pool and keeps it there, plus a small HTTP server for
the kubelet's probes and Prometheus.

Why not the wheel's ``mooncake_client`` binary: it names its IPC socket after its port in
the abstract namespace, so two of them on one host (pods sharing a network namespace, as in
the embedded cluster) cannot both start.

- ``GET /health``: 200 once the segment is mounted and the master answers on its RPC port,
  503 otherwise.
- ``GET /metrics``: ``mooncake_store_node_segment_bytes``, ``mooncake_store_node_up``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)
#: seconds a master RPC-port check may take
MASTER_CHECK_TIMEOUT_S = 1.0
DEFAULT_PORT = 50052


class StoreNodeSettings(BaseModel):
    """Settings of one store-node process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="address to serve on and to give the store")
    port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="HTTP port (probes, metrics)")
    master: str = Field(..., description="mooncake_master RPC address host:port")
    metadata: str = Field("P2PHANDSHAKE", description="metadata server (URL or P2PHANDSHAKE)")
    segment_bytes: int = Field(64 << 20, gt=0, description="memory lent to the pool")
    buffer_bytes: int = Field(16 << 20, gt=0, description="local transfer buffer")
    protocol: str = Field("tcp", pattern=r"^(tcp|rdma)$", description="transfer protocol")
    connect_timeout_s: float = Field(60.0, gt=0, description="give up when the master "
                                     "does not answer by then")


class StoreNode:
    def __init__(self, settings: StoreNodeSettings) -> None:
        self.settings = settings
        self.store: Any = None
        self.registry = CollectorRegistry()
        self.segment = Gauge("mooncake_store_node_segment_bytes",
                             "Memory this node lends to the store", registry=self.registry)
        self.up = Gauge("mooncake_store_node_up", "1 while the segment is mounted",
                        registry=self.registry)

    async def master_reachable(self) -> bool:
        host, _, port = self.settings.master.rpartition(":")
        try:
            _r, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                           MASTER_CHECK_TIMEOUT_S)
        except (OSError, ValueError, TimeoutError):
            return False
        w.close()
        return True

    def _mount(self) -> Any:
        s = self.settings
        # pin the transfer engine's listener to this pod's address
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", s.host)
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(s.host, s.metadata, s.segment_bytes, s.buffer_bytes, s.protocol, "",
                         s.master)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store setup failed (rc={rc}) for {s.master}")
        return store

    async def mount(self) -> None:
        """Wait for the master (the binding would block forever on an absent one), then
        mount the segment."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.connect_timeout_s
        while not await self.master_reachable():
            if loop.time() > deadline:
                raise RuntimeError(f"store master {self.settings.master} not reachable")
            await asyncio.sleep(MASTER_CHECK_TIMEOUT_S)
        self.store = await asyncio.to_thread(self._mount)
        self.segment.set(self.settings.segment_bytes)
        self.up.set(1)
        log.info("lent %d bytes to the store at %s", self.settings.segment_bytes,
                 self.settings.master)

    async def health(self, _req: web.Request) -> web.Response:
        ok = self.store is not None and await self.master_reachable()
        return web.json_response({"status": "ok" if ok else "unavailable",
                                  "segment_bytes": self.settings.segment_bytes},
                                 status=200 if ok else 503)

    async def metrics(self, _req: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, self.settings.port)
        await site.start()
        print(f"store node serving on http://{self.settings.host}:{self.settings.port}",
              flush=True)
        try:
            await self.mount()
            await asyncio.Event().wait()
        finally:
            if self.store is not None:
                await asyncio.to_thread(self.store.close)
                self.up.set(0)
            await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    values = {k: v for k, v in vars(args).items()
              if k in StoreNodeSettings.model_fields and v is not None}
    try:
        settings = StoreNodeSettings(**values)
    except ValidationError as exc:
        print(f"invalid store-node settings:\n{exc}", file=sys.stderr)
        return 2
    from mooncake_contract.lifecycle import run_until_stopped

    try:
        run_until_stopped(StoreNode(settings).serve)
    except (RuntimeError, OSError) as exc:
        print(f"store node failed: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "store-node", help="lend this node's memory to a Mooncake Store (store DaemonSet)",
        description="Mount a segment of this node's memory into a Mooncake Store's global "
        "pool with the real store client, and serve /health and /metrics.")
    d = StoreNodeSettings.model_fields
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--master", required=True, help="mooncake_master RPC host:port")
    p.add_argument("--metadata", default=d["metadata"].default)
    p.add_argument("--segment-bytes", type=int, default=d["segment_bytes"].default)
    p.add_argument("--buffer-bytes", type=int, default=d["buffer_bytes"].default)
    p.add_argument("--protocol", default=d["protocol"].default)
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float,
                   default=d["connect_timeout_s"].default)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run)
