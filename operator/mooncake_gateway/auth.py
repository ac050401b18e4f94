"""The gateway's front door: API keys, an admin role, and per-key limits.

**Keys** are read from directories laid out the way Kubernetes mounts a Secret: one file
per key, whose name names the key (in metrics and logs) and whose content is the key
itself. ``keys_dir`` holds the keys that may call the OpenAI routes; ``admin_keys_dir``
holds the keys that may also call the admin API (``/conductor/*``). Hidden entries (the
``..data`` links a Secret volume keeps) are skipped. A client sends its key as
``Authorization: Bearer <key>``, as OpenAI's clients do.

**Rotation without a restart.** The directories are read again at most every
``reload_s`` seconds, when a request arrives. The kubelet swaps a mounted Secret's files
atomically, so a rotated key works (and a removed one stops working) within the kubelet's
sync period plus ``reload_s``. A directory that cannot be read keeps the keys read last
and logs why (a mount being swapped must not lock every client out); a gateway that never
read a key answers every protected route 401.

**Open routes.** ``/health``, ``/ready`` and ``/metrics`` never ask for a key: probes and
Prometheus must not hold one.

**Per-key limits** (the rule of OpenAI's and Anthropic's public rate limits): requests and
tokens per minute, each a token bucket that holds one minute's worth and refills
continuously. A request is charged its prompt tokens plus ``max_tokens`` before it is
routed, so nothing is prefilled for a request over its key's limit. Every key has buckets
of its own: one key over its limit never delays another. A refused request gets 429 with
``Retry-After``, the seconds until its bucket holds enough.

**Replicas.** A gateway asks its peers for their load (``/conductor/load``, peers.py)
with the first admin key by file name, so the replicas need the same admin Secret.

Nothing here ever logs, counts or returns a key: only its file name.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from mooncake_contract.keydir import read_key_dir

from .errors import ApiError
from .settings import AuthSettings

log = logging.getLogger(__name__)

#: routes that answer without a key (probes, Prometheus)
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
#: routes under this prefix need an admin key
ADMIN_PREFIX = "/conductor/"
#: the credential scheme OpenAI's clients send
BEARER = "bearer "
#: seconds per minute: limits are per minute, buckets refill per second
MINUTE_S = 60.0
#: Retry-After for a request larger than its key's whole per-minute budget (it never fits:
#: the client should lower max_tokens, not wait; a minute is when the limit is read again)
TOO_LARGE_RETRY_S = 60


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request's key says it is."""

    name: str
    admin: bool


def _digest(key: str) -> bytes:
    # keys are compared by digest: a dict lookup then leaks nothing about a key's bytes
    return hashlib.sha256(key.encode("utf-8")).digest()


class KeyRing:
    """The keys in force, read again from their directories when ``reload_s`` has passed."""

    def __init__(self, settings: AuthSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._by_digest: dict[bytes, Principal] = {}
        self._read_at = -math.inf
        self.reloads = 0
        #: the key this gateway sends to its peers (the first admin key by name)
        self.peer_key: str | None = None
        if settings.enabled:
            self.refresh()

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def names(self) -> list[str]:
        return sorted({p.name for p in self._by_digest.values()})

    def refresh(self) -> None:
        """Read both directories; a directory that fails keeps what it held before."""
        s = self.settings
        self._read_at = self._clock()
        found: dict[bytes, Principal] = {}
        for directory, admin in ((s.keys_dir, False), (s.admin_keys_dir, True)):
            if directory is None:
                continue
            try:
                keys = read_key_dir(directory)
            except OSError as exc:
                log.warning("cannot read API keys from %s (%s); keeping the keys read "
                            "before", directory, exc.strerror or type(exc).__name__)
                found.update({d: p for d, p in self._by_digest.items() if p.admin == admin})
                continue
            if admin:
                self.peer_key = keys[min(keys)] if keys else None
            for name, key in keys.items():
                digest = _digest(key)
                # the same key in both directories is an admin key
                if admin or digest not in found:
                    found[digest] = Principal(name, admin)
        if set(found) != set(self._by_digest):
            log.info("API keys loaded: %d (%d admin)", len(found),
                     sum(p.admin for p in found.values()))
        self._by_digest = found
        self.reloads += 1

    def authenticate(self, header: str | None) -> Principal:
        """The principal of an ``Authorization`` header value; ``ApiError`` 401 otherwise."""
        if self._clock() - self._read_at >= self.settings.reload_s:
            self.refresh()
        if not header or not header[: len(BEARER)].lower() == BEARER:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="missing_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="mooncake"'})
        principal = self._by_digest.get(_digest(header[len(BEARER):].strip()))
        if principal is None:
            raise ApiError(401, "invalid API key", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return principal

    def authorize(self, path: str, header: str | None) -> Principal | None:
        """The principal a request to ``path`` runs as: ``None`` on an open route or with
        no keys configured; ``ApiError`` 401 without a valid key, 403 for a key that may
        not call the admin API."""
        if not self.enabled or path in OPEN_PATHS:
            return None
        principal = self.authenticate(header)
        if path.startswith(ADMIN_PREFIX) and not principal.admin:
            raise ApiError(403, "this key may not call the admin API", code="forbidden")
        return principal


class LimitExceeded(ApiError):
    """A key over its own limit (429): the client's budget, not the cluster's load."""


class Bucket:
    """A token bucket holding ``capacity`` and refilling at ``rate`` per second."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / MINUTE_S
        self.level = per_minute
        self.stamp = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if the bucket holds it (0.0 returned); else take nothing and
        return the seconds until it would (``inf`` when it never can)."""
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate


class KeyLimiter:
    """Each key's request and token buckets (created on the key's first request)."""

    def __init__(self, settings: AuthSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}

    def _check(self, buckets: dict[str, Bucket], per_minute: float, name: str,
               amount: float, what: str) -> None:
        if per_minute <= 0:
            return
        now = self._clock()
        bucket = buckets.get(name)
        if bucket is None:
            bucket = buckets[name] = Bucket(per_minute, now)
        wait = bucket.take(amount, now)
        if wait == 0.0:
            return
        if math.isinf(wait):
            raise LimitExceeded(429, f"this request needs {amount:g} {what}, more than the key's "
                           f"limit of {per_minute:g} {what} per minute; lower max_tokens or "
                           "shorten the prompt", code=f"{what}_limit_exceeded",
                           headers={"Retry-After": str(TOO_LARGE_RETRY_S)})
        raise LimitExceeded(429, f"rate limit of {per_minute:g} {what} per minute reached for "
                       f"this key; retry in {wait:.1f} s", code=f"{what}_limit_exceeded",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def request(self, principal: Principal | None) -> None:
        """Charge one request to its key; ``ApiError`` 429 over the limit."""
        if principal is not None:
            self._check(self._requests, self.settings.requests_per_minute, principal.name,
                        1.0, "requests")

    def tokens(self, principal: Principal | None, amount: int) -> None:
        """Charge a request's prompt + max_tokens to its key; ``ApiError`` 429 over it."""
        if principal is not None:
            self._check(self._tokens, self.settings.tokens_per_minute, principal.name,
                        float(amount), "tokens")
