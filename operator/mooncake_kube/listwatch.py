"""Keep a set of objects current: list, then watch from the list's version, in a thread.

What an informer does, for the few sets the gateway follows (its engines' pods, its
peers, its model ConfigMaps): ``report`` gets the whole set (``namespace/name`` → object
dict) after every list and every event. An API error (a server restart, an expired
version, a rotated token) lists again after ``backoff_s``; a watch the server ends
(``timeout_s``) lists again at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from .client import KubeClient, Stream

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
#: seconds between lists after an API error
BACKOFF_S = 2.0


def object_key(obj: JsonDict) -> str:
    """``namespace/name`` of an object."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class ListWatch:
    """The objects at ``path`` (a collection: ``/api/v1/namespaces/ns/pods``, or
    ``/api/v1/pods`` for every namespace) that match ``selector``."""

    def __init__(self, client: KubeClient, path: str, selector: str, timeout_s: int,
                 report: Callable[[dict[str, JsonDict]], None], what: str,
                 backoff_s: float | None = None) -> None:
        self.client = client
        self.path = path
        self.selector = selector
        self.timeout_s = timeout_s
        self.report = report
        self.what = what
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self._stop = threading.Event()
        self._stream: Stream | None = None
        self._thread: threading.Thread | None = None

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

    def _run(self) -> None:
        query = {"labelSelector": self.selector} if self.selector else {}
        while not self._stop.is_set():
            try:
                listing = self.client.call("GET", self.path, query=query or None)
                objects = {object_key(o): o for o in listing.get("items") or []}
                self.report(dict(objects))
                version = (listing.get("metadata") or {}).get("resourceVersion", "")
                self._stream = self.client.watch(
                    self.path, dict(query, resourceVersion=version), self.timeout_s)
                if self._stop.is_set():
                    break
                for event in self._stream:
                    if self._stop.is_set():
                        break
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # 410 Gone and the like: list again
                        raise RuntimeError(obj.get("message") or "watch error")
                    if kind == "DELETED":
                        objects.pop(object_key(obj), None)
                    elif kind in ("ADDED", "MODIFIED"):
                        objects[object_key(obj)] = obj
                    else:  # BOOKMARK
                        continue
                    self.report(dict(objects))
            except Exception as exc:  # the API server restarts, tokens rotate: retry
                if self._stop.is_set():
                    break
                log.warning("%s watch (%s) failed: %s", self.what, self.selector, exc)
                self._stop.wait(self.backoff_s)
            finally:
                stream, self._stream = self._stream, None
                if stream is not None:
                    with contextlib.suppress(Exception):
                        stream.close()
