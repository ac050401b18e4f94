"""Keep pod listeners on their pod's loopback address: a ``bind()`` shim for pod processes.

The embedded cluster's pods share the host's network, each with its own address in
``127.0.0.0/8``. A process that listens on every interface (``0.0.0.0`` or ``::``) would
then be reachable from outside the host. Some cannot be told otherwise: the Mooncake
transfer engine (PyPI wheel) listens on ``0.0.0.0`` and ``[::]`` whatever
``MC_TCP_BIND_ADDRESS`` says, and ``mooncake_master``'s HTTP metadata server ignores
``--http_metadata_server_host``.

Rule: the pod runner starts every container with ``LD_PRELOAD`` naming a small library
(built here, once, by the C compiler, cached by the hash of its source) and
:data:`PIN_ENV` set to the pod's IP. Its ``bind()`` rewrites a TCP socket's wildcard
address: ``0.0.0.0`` becomes the pod's IP; ``::`` becomes the pod's IP as an IPv4-mapped
address (``::ffff:127.x.y.z``), or ``::1`` on an IPv6-only socket. Every other bind, UDP
included, is passed through unchanged. Statically linked programs (Go) are not affected;
none runs as a pod here. Without a C compiler nothing is built, the runner logs that
pods listen where they choose, and the tests that need the pin fail with the install line.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from .settings import LocalClusterSettings

#: the environment variable naming the address wildcard binds are pinned to
PIN_ENV = "MOONCAKE_BIND_PIN"
LIBRARY_NAME = "libmooncake_bindpin.so"
COMPILERS = ("cc", "gcc", "clang")
BUILD_TIMEOUT_S = 120

SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int is_tcp(int fd) {
    int type = 0;
    socklen_t len = sizeof type;
    return getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *pin = getenv("MOONCAKE_BIND_PIN");
    struct in_addr pinned;
    if (!pin || !addr || inet_pton(AF_INET, pin, &pinned) != 1 || !is_tcp(fd))
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            in4.sin_addr = pinned;
            return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
            int v6only = 0;
            socklen_t olen = sizeof v6only;
            getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &olen);
            memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
            if (v6only) {
                in6.sin6_addr = in6addr_loopback;
            } else {
                in6.sin6_addr.s6_addr[10] = 0xff;
                in6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&in6.sin6_addr.s6_addr[12], &pinned, sizeof pinned);
            }
            return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return real_bind(fd, addr, len);
}
"""


def _digest() -> str:
    return hashlib.sha256(SOURCE.encode()).hexdigest()[:12]


def library_path(settings: LocalClusterSettings) -> Path:
    """Where the library of this source lives in the cache (built or not)."""
    return settings.cache_root / f"bindpin-{_digest()}" / LIBRARY_NAME


def built(settings: LocalClusterSettings) -> Path | None:
    """The library, if it has been built."""
    path = library_path(settings)
    return path if path.is_file() else None


def compiler() -> str | None:
    return next((c for c in COMPILERS if shutil.which(c)), None)


def build(settings: LocalClusterSettings, log: Callable[[str], None] = print) -> Path | None:
    """Build the library into the cache unless it is there; ``None`` (logged) without a C
    compiler."""
    out = library_path(settings)
    if out.is_file():
        log(f"[cached] bind pin: {out}")
        return out
    cc = compiler()
    if cc is None:
        log("[skip] bind pin: no C compiler (cc, gcc or clang); pods will listen where "
            "they choose, including every interface")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".c")
    src.write_text(SOURCE)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(tmp), str(src), "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the bind pin failed ({' '.join(cmd)}):\n"
                           f"{done.stdout}{done.stderr}")
    tmp.replace(out)
    log(f"[done] bind pin -> {out}")
    return out


def pinned_env(library: Path | None, pod_ip: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the library preloaded and binds pinned to ``pod_ip`` (unchanged when
    there is no library)."""
    if library is None:
        return env
    out = dict(env)
    preload = out.get("LD_PRELOAD", "")
    out["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    out[PIN_ENV] = pod_ip
    return out
