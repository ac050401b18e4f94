"""The service proxy: a kube-proxy stand-in for the local cluster (loopback only).

The API server refuses loopback addresses in Endpoints/EndpointSlices, so nothing
publishes endpoints for our pods (their IPs are in 127.1.N.0/24). Instead, this process
list+watches Services and Pods itself and, for every Service with a loopback ClusterIP
(the service range is in 127/8) and a selector, listens on ``ClusterIP:port`` for each
TCP port. Each accepted connection goes to one ready pod (Ready condition True, not
terminating, a pod IP) that matches the selector in the Service's namespace, at the
resolved ``targetPort`` (a number, a named container port, or the port), round-robin;
if that pod refuses, the next one is tried. Without a ready pod the connection is reset
at once. ``default/kubernetes`` forwards to the API server. Listeners follow Service
changes; routing follows pod changes at each new connection.

Traffic only ever goes to 127/8: non-loopback ClusterIPs and pod IPs are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_kube.listwatch import SYNC, Emit, fold, follow, object_ref

from mooncake_localcluster import services
from mooncake_localcluster.cluster import kube_client, open_state
from mooncake_localcluster.kubehttp import KubeHttp
from mooncake_localcluster.settings import LocalClusterSettings

log = logging.getLogger("mooncake.localcluster.serviceproxy")
JsonDict = dict[str, Any]
Address = tuple[str, int]

BUFFER_BYTES = 64 * 1024
LISTEN_BACKLOG = 1024
RESYNC_S = 5.0  # retry listeners that could not bind (e.g. a port still in use)
PODS = "pods"
SERVICES = "services"
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a RST


@dataclass(frozen=True)
class Route:
    """What one listener serves: a Service port, or a fixed target (the API server)."""

    service: tuple[str, str]
    port: JsonDict
    fixed: Address | None = None


def desired_routes(service_objs: list[JsonDict], apiserver: Address) -> dict[Address, Route]:
    """ClusterIP:port -> route for every Service the proxy serves."""
    routes: dict[Address, Route] = {}
    for svc in service_objs:
        ip = services.cluster_ip(svc)
        master = services.is_master(svc)
        if ip is None or not services.is_loopback(ip):
            continue
        if not master and not services.proxied(svc):
            continue
        meta = svc.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        for port in services.tcp_ports(svc):
            fixed = apiserver if master else None
            routes[(ip, int(port["port"]))] = Route(key, port, fixed)
    return routes


def rotate(candidates: list[Address], counter: int) -> list[Address]:
    """Round-robin: start at ``counter`` modulo the count, then the others in order."""
    if not candidates:
        return []
    start = counter % len(candidates)
    return candidates[start:] + candidates[:start]


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()


async def _pump(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, other: asyncio.StreamWriter
) -> None:
    """Copy until EOF, then half-close ``dst``; on an error, abort both sides."""
    try:
        while data := await src.read(BUFFER_BYTES):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof() and not dst.is_closing():
            dst.write_eof()
    except (OSError, RuntimeError):
        dst.transport.abort()
        other.transport.abort()


class ServiceProxy:
    def __init__(
        self, settings: LocalClusterSettings, client: KubeHttp, apiserver: Address
    ) -> None:
        self.settings = settings
        self.client = client
        self.apiserver = apiserver
        self.services: dict[tuple[str, str], JsonDict] = {}
        self.pods: dict[str, dict[str, services.PodView]] = {}  # namespace -> uid -> view
        self.routes: dict[Address, Route] = {}
        self.listeners: dict[Address, asyncio.Server] = {}
        self.counters: dict[Address, int] = {}
        self.bind_errors: dict[Address, str] = {}
        self.stopping = threading.Event()
        self.changed = asyncio.Event()

    # ----- state from the watches (called in the loop thread) ------------------------
    def on_event(self, resource: str, kind: str, obj: JsonDict) -> None:
        if resource == SERVICES:
            self._on_service(kind, obj)
        else:
            self._on_pod(kind, obj)

    def _on_service(self, kind: str, obj: JsonDict) -> None:
        self.services = fold(self.services, kind, obj, object_ref)
        self.changed.set()

    def _on_pod(self, kind: str, obj: JsonDict) -> None:
        if kind == SYNC:
            self.pods = {}
            for pod in obj["items"]:
                self._put_pod(pod)
            return
        if kind == "DELETED":
            meta = obj.get("metadata") or {}
            self.pods.get(str(meta.get("namespace", "")), {}).pop(str(meta.get("uid", "")), None)
        else:
            self._put_pod(obj)

    def _put_pod(self, pod: JsonDict) -> None:
        view = services.pod_view(pod)
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        self.pods.setdefault(view.namespace, {})[uid] = view

    # ----- routing -------------------------------------------------------------------
    def candidates(self, address: Address) -> list[Address]:
        """Backends for a new connection to ``address``, the round-robin pick first."""
        route = self.routes.get(address)
        if route is None:
            return []
        if route.fixed is not None:
            return [route.fixed]
        svc = self.services.get(route.service)
        if svc is None:
            return []
        found = services.backends(svc, route.port, self.pods.get(route.service[0], {}).values())
        counter = self.counters.get(address, 0)
        self.counters[address] = counter + 1
        return rotate(found, counter)

    async def _handle(
        self, address: Address, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        for host, port in self.candidates(address):
            try:
                upstream = await asyncio.wait_for(
                    asyncio.open_connection(host, port),
                    timeout=self.settings.proxy_connect_timeout_s,
                )
                break
            except (OSError, TimeoutError) as err:
                log.debug("%s:%s -> %s:%s failed: %s", *address, host, port, err)
        if upstream is None:
            _reset(writer)
            return
        up_reader, up_writer = upstream
        try:
            await asyncio.gather(
                _pump(reader, up_writer, writer), _pump(up_reader, writer, up_writer)
            )
        finally:
            for w in (writer, up_writer):
                w.close()

    # ----- listeners -----------------------------------------------------------------
    async def reconcile(self) -> None:
        """Open listeners for new routes, close those of routes that went away."""
        self.routes = desired_routes(list(self.services.values()), self.apiserver)
        for address in list(self.listeners):
            if address not in self.routes:
                self.listeners.pop(address).close()
                self.counters.pop(address, None)
                log.info("closed %s:%s", *address)
        for address in self.routes:
            if address in self.listeners:
                continue
            try:
                self.listeners[address] = await asyncio.start_server(
                    functools.partial(self._handle, address),
                    host=address[0],
                    port=address[1],
                    reuse_address=True,
                    backlog=LISTEN_BACKLOG,
                )
                self.bind_errors.pop(address, None)
                log.info("listening on %s:%s for %s/%s", *address, *self.routes[address].service)
            except OSError as err:
                if self.bind_errors.get(address) != str(err):
                    log.warning("cannot listen on %s:%s: %s", *address, err)
                self.bind_errors[address] = str(err)
        for address in list(self.bind_errors):
            if address not in self.routes:
                del self.bind_errors[address]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        def emitter(resource: str) -> Emit:
            def emit(kind: str, obj: JsonDict) -> None:
                loop.call_soon_threadsafe(self.on_event, resource, kind, obj)

            return emit

        for resource in (SERVICES, PODS):
            threading.Thread(
                target=follow,
                args=(self.client.client, f"/api/v1/{resource}", emitter(resource),
                      self.stopping),
                name=f"{resource}-watch",
                daemon=True,
            ).start()
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout=RESYNC_S)
            self.changed.clear()
            if not self.stopping.is_set():
                await self.reconcile()
        for server in self.listeners.values():
            server.close()


def main(state_dir: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    opened = open_state(state_dir, log.error)
    if opened is None:
        return 1
    settings, paths, info = opened
    proxy = ServiceProxy(
        settings, kube_client(paths, info.server), (info.host, info.ports["apiserver"])
    )

    async def serve() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            proxy.stopping.set()
            proxy.changed.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop)
        await proxy.run()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="local-cluster service proxy")
    parser.add_argument("--state-dir", required=True)
    sys.exit(main(Path(parser.parse_args().state_dir)))
