"""The one Kubernetes client against a fake API server on loopback: answers, errors,
unreachable servers, watches that a close ends, and the list-watch loop."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from mooncake_kube.client import KubeClient, KubeError, KubeUnreachable, _lines
from mooncake_kube.listwatch import SYNC, ListWatch, follow, object_key

from ..fake_kube import FakeKube, fake_kube


def _pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels or {"a": "b"}}}


def test_lines_are_whole_whatever_the_chunks() -> None:
    chunks = [b'{"a"', b': 1}\n{"b": 2}\n\n{"c"', b": 3}"]
    assert list(_lines(iter(chunks))) == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}']


def test_a_list_with_a_query_in_the_path_and_in_the_arguments() -> None:
    with fake_kube() as k:
        k.put("pods", _pod("p1"))
        k.put("pods", _pod("p2", {"a": "c"}))
        out = k.client().call("GET", "/api/v1/namespaces/ns/pods?labelSelector=a%3Db",
                              query={"limit": "5"})
        assert [p["metadata"]["name"] for p in out["items"]] == ["p1"]
        assert "labelSelector=a%3Db" in k.requests[-1] and "limit=5" in k.requests[-1]


def test_api_errors_carry_the_status_the_message_and_the_request() -> None:
    with fake_kube() as k:
        k.fail_next = 1
        with pytest.raises(KubeError) as failed:
            k.client().call("GET", "/api/v1/pods")
        assert failed.value.status == 500 and failed.value.message == "restarting"
        assert failed.value.request == "GET /api/v1/pods"
        assert '"restarting"' in failed.value.body  # the raw answer, for callers that parse it
        with pytest.raises(KubeError) as missing:
            k.client().call("GET", "/api/v1/secrets")
        assert missing.value.status == 404


def test_an_unreachable_server_is_an_oserror() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    import kubernetes

    conf = kubernetes.client.Configuration()
    conf.host = f"http://127.0.0.1:{port}"
    conf.retries = 0
    client = KubeClient(kubernetes.client.ApiClient(conf))
    with pytest.raises(KubeUnreachable) as err:
        client.call("GET", "/api/v1/pods")
    assert isinstance(err.value, OSError)


def test_a_watch_streams_events_and_a_close_from_another_thread_ends_it() -> None:
    with fake_kube() as k:
        k.put("pods", _pod("p1"))
        stream = k.client().watch("/api/v1/namespaces/ns/pods", {"resourceVersion": "1"}, 60)
        got: list[tuple[str, str]] = []
        done = threading.Event()

        def read() -> None:
            try:
                for event in stream:
                    got.append((event["type"], event["object"]["metadata"]["name"]))
            except OSError:
                pass  # a closed connection may end the read with an error
            done.set()

        threading.Thread(target=read, daemon=True).start()
        k.put("pods", _pod("p2"))
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [("ADDED", "p1"), ("ADDED", "p2")]
        started = time.monotonic()
        stream.close()
        assert done.wait(5), "a closed watch kept its reader blocked"
        assert time.monotonic() - started < 5


def _follow(k: FakeKube, selector: str, steps: list[Any]) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    lw = ListWatch(k.client(), "/api/v1/namespaces/ns/pods", selector, 60,
                   lambda objs: seen.append(objs), "test", backoff_s=0.01)
    lw.start()
    try:
        for step in steps:
            count = len(seen)
            step()
            deadline = time.monotonic() + 5
            while len(seen) == count and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        lw.stop()
        lw.join(5)
    return seen


def test_the_list_watch_reports_the_whole_set_after_each_change() -> None:
    with fake_kube() as k:
        k.put("pods", _pod("p1"))
        seen = _follow(k, "a=b", [
            lambda: None,  # the list
            lambda: k.put("pods", _pod("p2")),
            lambda: k.put("pods", _pod("p1", {"a": "b", "x": "y"})),
            lambda: k.delete("pods", "ns", "p2"),
        ])
    assert [sorted(s) for s in seen] == [["ns/p1"], ["ns/p1", "ns/p2"], ["ns/p1", "ns/p2"],
                                         ["ns/p1"]]
    assert seen[2]["ns/p1"]["metadata"]["labels"] == {"a": "b", "x": "y"}
    assert object_key(_pod("q")) == "ns/q"


def test_the_list_watch_lists_again_after_an_error() -> None:
    with fake_kube() as k:
        k.put("pods", _pod("p1"))
        k.fail_next = 1
        seen = _follow(k, "", [lambda: None])
        lists = [r for r in k.requests if "watch=" not in r]
    assert seen[0] == {"ns/p1": k.objects["pods"][("ns", "p1")]}
    assert len(lists) == 2  # the refused list, then one that served


def test_follow_watches_again_from_the_last_version_when_a_watch_ends() -> None:
    """A watch the server ends (its timeout) resumes from the last version seen: no
    second LIST, nothing emitted twice."""
    with fake_kube() as k:
        k.put("pods", _pod("p1"))
        events: list[tuple[str, str]] = []
        stopping = threading.Event()

        def emit(kind: str, obj: dict[str, Any]) -> None:
            names = [object_key(o) for o in obj["items"]] if kind == SYNC else [object_key(obj)]
            events.extend((kind, n) for n in names)

        thread = threading.Thread(target=follow, args=(
            k.client(), "/api/v1/namespaces/ns/pods", emit, stopping),
            kwargs={"timeout_s": 1}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while k.watchers() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        k.put("pods", _pod("p2"))
        while k.watchers() < 3 and time.monotonic() < deadline:  # two watches ended
            time.sleep(0.05)
        k.put("pods", _pod("p3"))
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        stopping.set()
        lists = [r for r in k.requests if "watch=" not in r]
        versions = [r.split("resourceVersion=")[1].split("&")[0]
                    for r in k.requests if "watch=" in r]
    assert events == [(SYNC, "ns/p1"), ("ADDED", "ns/p2"), ("ADDED", "ns/p3")]
    assert len(lists) == 1
    assert versions[0] == "2" and set(versions[1:]) == {"3"}  # resumed after p2's version
