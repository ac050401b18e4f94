"""Keep up with a collection: list, then watch from the list's version, in a thread.

:func:`follow` is the loop an informer runs: LIST, hand the items over as one ``SYNC``
event, then WATCH from the list's resourceVersion, with bookmarks, and watch again from
the last version seen when the server ends a watch. Any error (a ``410 Gone``, an API
server restart, a rotated token, a broken connection) lists again after ``retry_s``.
The embedded cluster's pod runner and service proxy take its events one by one;
:class:`ListWatch` (the gateway's pods, peers and model ConfigMaps) folds them into the
whole set and reports it after every change.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .client import KubeClient, KubeError, Stream

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
Emit = Callable[[str, JsonDict], None]
#: the event :func:`follow` emits after each LIST: ``{"items": [...]}``
SYNC = "SYNC"
#: seconds the server keeps one watch open
WATCH_TIMEOUT_S = 300
#: seconds between lists after an error
RETRY_S = 1.0


Key = TypeVar("Key", bound=Hashable)


def object_ref(obj: JsonDict) -> tuple[str, str]:
    """(namespace, name) of an object."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def object_key(obj: JsonDict) -> str:
    """``namespace/name`` of an object."""
    return "/".join(object_ref(obj))


def fold(objects: dict[Key, JsonDict], kind: str, obj: JsonDict,
         key: Callable[[JsonDict], Key]) -> dict[Key, JsonDict]:
    """The set after one event of :func:`follow`: a new one after a ``SYNC``, else
    ``objects`` itself with ``obj`` put or (``DELETED``) taken out."""
    if kind == SYNC:
        return {key(o): o for o in obj["items"]}
    if kind == "DELETED":
        objects.pop(key(obj), None)
    else:
        objects[key(obj)] = obj
    return objects


def follow(client: KubeClient, path: str, emit: Emit, stopping: threading.Event,
           params: dict[str, str] | None = None,
           on_sync: Callable[[], None] | None = None,
           timeout_s: int = WATCH_TIMEOUT_S, retry_s: float | None = None,
           on_stream: Callable[[Stream | None], None] | None = None) -> None:
    """Run until ``stopping`` is set: ``emit(SYNC, {"items": ...})`` after each LIST
    (then ``on_sync()``), ``emit(type, object)`` per ADDED, MODIFIED or DELETED event.
    ``path`` is a collection (``/api/v1/pods``); ``params`` its selectors. ``on_stream``
    is told of each open watch (and of None when it ends), so that another thread can
    close it."""
    base = dict(params or {})
    pause = RETRY_S if retry_s is None else retry_s
    while not stopping.is_set():
        try:
            listing = client.call("GET", path, query=base or None)
            version = str((listing.get("metadata") or {}).get("resourceVersion", ""))
            emit(SYNC, {"items": listing.get("items") or []})
            if on_sync is not None:
                on_sync()
            while not stopping.is_set():
                query = dict(base, resourceVersion=version, allowWatchBookmarks="true")
                stream = client.watch(path, query, timeout_s)
                if on_stream is not None:
                    on_stream(stream)
                try:
                    if stopping.is_set():  # stopped while the watch opened
                        return
                    for event in stream:
                        if stopping.is_set():
                            return
                        kind = str(event.get("type", ""))
                        obj = event.get("object") or {}
                        if kind == "ERROR":  # 410 Gone and the like: list again
                            raise KubeError(int(obj.get("code", 500)),
                                            str(obj.get("message")), f"WATCH {path}")
                        meta = obj.get("metadata") or {}
                        version = str(meta.get("resourceVersion", version))
                        if kind != "BOOKMARK":
                            emit(kind, obj)
                finally:
                    if on_stream is not None:
                        on_stream(None)
                    with contextlib.suppress(Exception):
                        stream.close()
        except Exception as err:  # the API server restarts, tokens rotate: list again
            if stopping.is_set():
                return
            log.warning("watch of %s (%s) restarted: %s: %s", path, base or "all",
                        type(err).__name__, err)
            stopping.wait(pause)


class ListWatch:
    """The objects at ``path`` that match ``selector``, in a thread; ``report`` gets the
    whole set (``namespace/name`` → object) after each LIST and each event."""

    def __init__(self, client: KubeClient, path: str, selector: str, timeout_s: int,
                 report: Callable[[dict[str, JsonDict]], None], what: str,
                 backoff_s: float | None = None) -> None:
        self.client = client
        self.path = path
        self.selector = selector
        self.timeout_s = timeout_s
        self.report = report
        self.what = what
        self.backoff_s = backoff_s
        self._stop = threading.Event()
        self._stream: Stream | None = None
        self._thread: threading.Thread | None = None
        self._objects: dict[str, JsonDict] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"k8s-watch-{self.what}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (a blocked watch is woken by closing its connection)."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _emit(self, kind: str, obj: JsonDict) -> None:
        self._objects = fold(self._objects, kind, obj, object_key)
        self.report(dict(self._objects))

    def _set_stream(self, stream: Stream | None) -> None:
        self._stream = stream

    def _run(self) -> None:
        params = {"labelSelector": self.selector} if self.selector else None
        follow(self.client, self.path, self._emit, self._stop, params,
               timeout_s=self.timeout_s, retry_s=self.backoff_s, on_stream=self._set_stream)
