"""List+watch of one resource with :class:`~mooncake_localcluster.kubehttp.KubeHttp`.

A blocking loop for a thread: LIST, hand the items over as one ``SYNC`` event, then
WATCH from the list's resourceVersion (with bookmarks), and LIST again after any error
(a ``410 Gone`` included). The pod runner and the service proxy both use it.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from mooncake_localcluster.kubehttp import ApiError, KubeHttp

log = logging.getLogger("mooncake.localcluster.watch")
JsonDict = dict[str, Any]
Emit = Callable[[str, JsonDict], None]

SYNC = "SYNC"
WATCH_TIMEOUT_S = 300
RETRY_DELAY_S = 1.0


def list_watch(
    client: KubeHttp,
    path: str,
    emit: Emit,
    stopping: threading.Event,
    params: dict[str, str] | None = None,
    on_sync: Callable[[], None] | None = None,
) -> None:
    """Run until ``stopping`` is set; ``emit(kind, obj)`` per event, ``SYNC`` after a LIST.

    ``on_sync`` runs after each ``SYNC`` has been emitted.
    """
    base = dict(params or {})
    while not stopping.is_set():
        try:
            query = f"?{urllib.parse.urlencode(base)}" if base else ""
            listing = client.get(path + query)
            version = str(listing["metadata"]["resourceVersion"])
            emit(SYNC, {"items": listing.get("items") or []})
            if on_sync is not None:
                on_sync()
            while not stopping.is_set():
                watch_params = dict(base, resourceVersion=version, allowWatchBookmarks="true")
                for event in client.watch(path, watch_params, WATCH_TIMEOUT_S):
                    kind = str(event.get("type", ""))
                    obj = event.get("object") or {}
                    if kind == "ERROR":
                        raise ApiError(int(obj.get("code", 500)), str(obj.get("message")))
                    version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                    if kind != "BOOKMARK":
                        emit(kind, obj)
        except (ApiError, OSError, ValueError, KeyError) as err:
            if not stopping.is_set():
                log.warning("watch of %s restarted: %s", path, err)
                stopping.wait(RETRY_DELAY_S)
