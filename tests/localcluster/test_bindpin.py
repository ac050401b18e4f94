"""Pod listeners stay on their pod's loopback address (``bindpin.py``): the shim's rule on
plain sockets, the Mooncake transfer engine and ``mooncake_master`` (which listen on every
interface whatever they are told), and a pod of the embedded cluster that asks for
``0.0.0.0``."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from mooncake_localcluster import bindpin, procs
from mooncake_localcluster.settings import LocalClusterSettings

from tests.cluster_fixtures import LocalK8s
from tests.localcluster.test_cluster import _runnable_pod, wait_for
from tests.needs import missing

PIN = "127.0.0.7"


@pytest.fixture(scope="module")
def library() -> Path:
    if bindpin.compiler() is None:
        missing("cc", "no C compiler: apt-get install gcc")
    lib = bindpin.build(LocalClusterSettings(), log=lambda _: None)
    assert lib is not None and lib.is_file()
    return lib


def listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            assert len(hexaddr) == width
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = ipaddress.ip_address(words)
            mapped = getattr(addr, "ipv4_mapped", None)
            out.append((f"::ffff:{mapped}" if mapped else str(addr), int(hexport, 16)))
    return out


def wildcard(addr: str) -> bool:
    return addr in ("0.0.0.0", "::")


def test_pinned_env_preloads_the_library_before_any_other() -> None:
    lib = Path("/cache/libpin.so")
    env = bindpin.pinned_env(lib, "127.1.0.9", {"LD_PRELOAD": "/x.so", "A": "1"})
    assert env["LD_PRELOAD"] == "/cache/libpin.so:/x.so" and env[bindpin.PIN_ENV] == "127.1.0.9"
    assert bindpin.pinned_env(None, "127.1.0.9", {"A": "1"}) == {"A": "1"}


def test_the_rule_on_plain_sockets(library: Path) -> None:
    code = textwrap.dedent("""
        import json, socket
        out = {}
        for key, fam, addr in (("v4", socket.AF_INET, "0.0.0.0"), ("v6", socket.AF_INET6, "::"),
                               ("explicit", socket.AF_INET, "127.0.0.1")):
            s = socket.socket(fam, socket.SOCK_STREAM); s.bind((addr, 0))
            out[key] = s.getsockname()[0]
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); s.bind(("::", 0))
        out["v6only"] = s.getsockname()[0]
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 0))
        out["udp"] = u.getsockname()[0]
        print(json.dumps(out))
    """)
    env = bindpin.pinned_env(library, PIN, dict(os.environ))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"v4": PIN, "v6": f"::ffff:{PIN}",
                                       "explicit": "127.0.0.1", "v6only": "::1",
                                       "udp": "0.0.0.0"}


@pytest.mark.store
def test_the_transfer_engine_and_the_master_stay_on_their_address(library: Path) -> None:
    # the testbed's master and its clients meet on 127.0.0.1: pin there
    code = textwrap.dedent("""
        import json, os, sys, time
        from mooncake_testbed.procs import run_master
        # as the worker does; without it, in a loopback-only namespace the engine finds
        # no LAN address and refuses to start
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        with run_master() as m:
            from mooncake.store import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            rc = s.setup("127.0.0.1", m.metadata, 32 << 20, 16 << 20, "tcp", "", m.rpc)
            print(json.dumps({"rc": rc, "pids": [os.getpid(), m.proc.pid]}), flush=True)
            sys.stdin.readline()
    """)
    env = bindpin.pinned_env(library, "127.0.0.1", dict(os.environ))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        assert info["rc"] == 0
        found = [(pid, a, p) for pid in info["pids"] for a, p in listeners(pid)]
        # the engine's own listeners and the master's metadata server were all asked for
        # the wildcard; every one is on an address of 127.0.0.0/8
        assert len(found) >= 3, found
        assert not [f for f in found if wildcard(f[1])], found
        assert all(a.removeprefix("::ffff:").startswith("127.") for _, a, _ in found), found
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.cluster
def test_a_pod_asking_for_every_interface_listens_on_its_pod_ip(
        k8s_cluster: LocalK8s, namespace: str) -> None:
    assert bindpin.built(LocalClusterSettings()) is not None, "the cluster build made no pin"
    http = k8s_cluster.http()
    pod = _runnable_pod("wild", ["python", "-m", "http.server", "--bind", "0.0.0.0", "8080"])
    http.post(f"/api/v1/namespaces/{namespace}/pods", pod)
    path = f"/api/v1/namespaces/{namespace}/pods/wild"

    def serving() -> Any:
        obj = http.get(path)
        ip = obj["status"].get("podIP")
        records = [r for r in procs.records(k8s_cluster.state_dir / "pod-pids")
                   if r.name.startswith(obj["metadata"]["uid"])]
        if not ip or not records:
            return None
        found = [x for r in records if procs.alive(r) for x in _tree_listeners(r.pid)]
        return (ip, found) if found else None

    ip, found = wait_for("the pod listening", serving)
    assert found == [(ip, 8080)] or found == [(f"::ffff:{ip}", 8080)], found
    http.delete(path)


def _tree_listeners(pid: int) -> list[tuple[str, int]]:
    """Listeners of ``pid`` and its children (the container runs under unshare)."""
    out = []
    pending = [pid]
    while pending:
        p = pending.pop()
        try:
            out += listeners(p)
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        pending += [int(c) for c in children]
    return out
