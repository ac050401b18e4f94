"""The front door (``mooncake_gateway/auth.py``): API keys from Secret-style directories,
rotated without a restart; an admin role for ``/conductor/*``; per-key limits that never
touch another key; open probes and metrics. Units with a fake clock, then end to end over
HTTP on both of the gateway's front ends (the fast one and aiohttp's)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from mooncake_gateway.auth import Bucket, KeyLimiter, KeyRing, LimitExceeded, Principal
from mooncake_gateway.errors import ApiError
from mooncake_gateway.settings import AuthSettings, GatewaySettings

from .scripted import MODEL, engines, model, prompt_ids, running_gateway

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_KEY = "sk-user-0123456789"
OTHER_KEY = "sk-other-9876543210"
ADMIN_KEY = "sk-admin-abcdefabcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _secret(directory: Path, **keys: str) -> Path:
    """A directory laid out as the kubelet mounts a Secret: the entries live in a
    timestamped folder behind ``..data``, each name a link into it."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = directory / f"..{len(list(directory.iterdir()))}"
    stamp.mkdir()
    for name, key in keys.items():
        (stamp / name).write_text(key + "\n")
    data = directory / "..data"
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamp.name)
    os.replace(tmp, data)  # the kubelet's atomic swap
    for entry in directory.iterdir():
        if not entry.name.startswith(".") and entry.is_symlink():
            entry.unlink()
    for name in keys:
        (directory / name).symlink_to(Path("..data") / name)
    return directory


def _bearer(key: str) -> str:
    return f"Bearer {key}"


def test_keys_come_from_a_secret_directory_and_admins_from_their_own(tmp_path: Path) -> None:
    users = _secret(tmp_path / "users", alice=USER_KEY, bob=OTHER_KEY)
    admins = _secret(tmp_path / "admins", ops=ADMIN_KEY)
    (users / "empty").write_text("  \n")  # skipped, never a key that matches ""
    ring = KeyRing(AuthSettings(keys_dir=users, admin_keys_dir=admins))
    assert ring.names() == ["alice", "bob", "ops"]
    assert ring.authorize(CMPL, _bearer(USER_KEY)) == Principal("alice", False)
    assert ring.authorize(CMPL, f"bearer  {OTHER_KEY} ") == Principal("bob", False)
    assert ring.authorize("/conductor/state", _bearer(ADMIN_KEY)) == Principal("ops", True)
    for path in ("/health", "/ready", "/metrics"):
        assert ring.authorize(path, None) is None
    for header, code in ((None, "missing_api_key"), ("Basic " + USER_KEY, "missing_api_key"),
                         ("Bearer ", "invalid_api_key"), ("Bearer nope", "invalid_api_key"),
                         (_bearer(USER_KEY + "x"), "invalid_api_key")):
        for path in (CMPL, "/v1/models", "/openapi.json", "/conductor/registry"):
            with pytest.raises(ApiError) as err:
                ring.authorize(path, header)
            assert (err.value.status, err.value.code) == (401, code)
            assert USER_KEY not in err.value.message
    with pytest.raises(ApiError) as err:
        ring.authorize("/conductor/decisions", _bearer(USER_KEY))
    assert (err.value.status, err.value.code) == (403, "forbidden")


def test_no_key_directory_means_an_open_door(tmp_path: Path) -> None:
    ring = KeyRing(AuthSettings())
    assert not ring.enabled
    assert ring.authorize(CMPL, None) is None
    assert ring.authorize("/conductor/state", None) is None


def test_a_key_in_both_directories_is_an_admin(tmp_path: Path) -> None:
    users = _secret(tmp_path / "users", shared=ADMIN_KEY)
    admins = _secret(tmp_path / "admins", ops=ADMIN_KEY)
    ring = KeyRing(AuthSettings(keys_dir=users, admin_keys_dir=admins))
    assert ring.authorize("/conductor/state", _bearer(ADMIN_KEY)) == Principal("ops", True)


def test_a_rotated_key_takes_effect_after_reload_s_without_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    users = _secret(tmp_path / "users", alice=USER_KEY)
    ring = KeyRing(AuthSettings(keys_dir=users, reload_s=5.0), clock)
    assert ring.authorize(CMPL, _bearer(USER_KEY)).name == "alice"  # type: ignore[union-attr]
    _secret(users, alice=OTHER_KEY)  # rotated: the old key is gone
    clock.now += 4.9
    assert ring.authorize(CMPL, _bearer(USER_KEY)).name == "alice"  # type: ignore[union-attr]
    clock.now += 0.2
    with pytest.raises(ApiError):
        ring.authorize(CMPL, _bearer(USER_KEY))
    assert ring.authorize(CMPL, _bearer(OTHER_KEY)).name == "alice"  # type: ignore[union-attr]


def test_an_unreadable_directory_keeps_the_keys_read_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    users = _secret(tmp_path / "users", alice=USER_KEY)
    admins = _secret(tmp_path / "admins", ops=ADMIN_KEY)
    ring = KeyRing(AuthSettings(keys_dir=users, admin_keys_dir=admins, reload_s=1.0), clock)
    gone = tmp_path / "gone"
    users.rename(gone)  # a mount being swapped
    clock.now += 2
    with caplog.at_level(logging.WARNING):
        assert ring.authorize(CMPL, _bearer(USER_KEY)) == Principal("alice", False)
    assert "cannot read API keys" in caplog.text
    assert ring.authorize("/conductor/state", _bearer(ADMIN_KEY)) == Principal("ops", True)
    # a gateway that never read a key refuses everyone
    never = KeyRing(AuthSettings(keys_dir=tmp_path / "missing"))
    with pytest.raises(ApiError) as err:
        never.authorize(CMPL, _bearer(USER_KEY))
    assert err.value.status == 401
    assert USER_KEY not in caplog.text and ADMIN_KEY not in caplog.text


def test_a_bucket_refills_continuously_and_says_when_it_will_hold_enough() -> None:
    b = Bucket(per_minute=60.0, now=0.0)  # 1 a second, 60 at most
    assert b.take(60, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(1.0)
    assert b.take(1, 0.5) == pytest.approx(0.5)  # nothing taken by a refused request
    assert b.take(1, 1.0) == 0.0
    assert b.take(61, 100.0) == math.inf  # more than a minute's worth never fits
    assert b.take(60, 100.0) == 0.0  # capped at capacity, not 100 s of refill


def test_each_key_has_its_own_budget_and_429_says_when_to_retry() -> None:
    clock = Clock()
    limits = KeyLimiter(AuthSettings(requests_per_minute=2, tokens_per_minute=100), clock)
    alice, bob = Principal("alice", False), Principal("bob", False)
    limits.request(alice)
    limits.request(alice)
    with pytest.raises(LimitExceeded) as err:
        limits.request(alice)
    assert err.value.status == 429 and err.value.code == "requests_limit_exceeded"
    assert err.value.headers["Retry-After"] == "30"
    limits.request(bob)  # alice's limit is not bob's
    limits.tokens(bob, 100)
    with pytest.raises(LimitExceeded) as err:
        limits.tokens(bob, 10)
    assert err.value.headers["Retry-After"] == "6"
    with pytest.raises(LimitExceeded) as err:
        limits.tokens(alice, 101)
    assert "lower max_tokens" in err.value.message
    limits.tokens(alice, 100)
    limits.request(None)  # no keys configured: nothing counted
    limits.tokens(None, 10 ** 9)
    clock.now += 30
    limits.request(alice)


def test_limits_of_zero_mean_no_limit() -> None:
    limits = KeyLimiter(AuthSettings())
    for _ in range(1000):
        limits.request(Principal("a", False))
        limits.tokens(Principal("a", False), 10 ** 6)


def test_settings_read_the_auth_block_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOONCAKE_GATEWAY_AUTH__KEYS_DIR", str(tmp_path))
    monkeypatch.setenv("MOONCAKE_GATEWAY_AUTH__TOKENS_PER_MINUTE", "5000")
    s = GatewaySettings()
    assert s.auth.keys_dir == tmp_path and s.auth.tokens_per_minute == 5000
    with pytest.raises(ValueError):
        AuthSettings(requests_per_minute=-1)


# -- end to end --------------------------------------------------------------------------

async def _call(url: str, method: str, path: str, key: str | None,
                body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": _bearer(key)} if key else {}
    data = None if body is None else json.dumps(body)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.request(method, url + path, headers=headers, data=data) as r:
        return r.status, dict(r.headers), await r.read()


def _body(stream: bool = False, max_tokens: int = 4) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt_ids(20), "max_tokens": max_tokens,
            "stream": stream}


def test_every_route_but_probes_and_metrics_needs_a_key_on_both_front_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    users = _secret(tmp_path / "users", alice=USER_KEY)
    admins = _secret(tmp_path / "admins", ops=ADMIN_KEY)

    async def main() -> None:
        auth = {"keys_dir": str(users), "admin_keys_dir": str(admins)}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], auth=auth) as gw:
            url = gw.url
            for path in ("/health", "/ready", "/metrics"):
                assert (await _call(url, "GET", path, None))[0] == 200, path
            protected = [("GET", "/v1/models"), ("GET", "/openapi.json"),
                         ("GET", "/conductor/state"), ("GET", "/conductor/registry"),
                         ("GET", "/conductor/decisions"), ("GET", "/conductor/hot-prefixes"),
                         ("GET", "/conductor/models")]
            for method, path in protected:
                for key in (None, "sk-wrong"):
                    status, headers, raw = await _call(url, method, path, key)
                    assert status == 401, (path, raw)
                    assert "WWW-Authenticate" in headers
                    assert json.loads(raw)["error"]["type"] == "authentication_error"
            for stream in (False, True):  # the fast front end, then aiohttp's
                for path in (CMPL, CHAT):
                    body = _body(stream) if path == CMPL else {
                        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                        "stream": stream}
                    status, _h, raw = await _call(url, "POST", path, None, body)
                    assert status == 401, raw
                    status, _h, raw = await _call(url, "POST", path, "sk-wrong", body)
                    assert status == 401, raw
                    status, _h, raw = await _call(url, "POST", path, USER_KEY, body)
                    assert status == 200, raw
            assert len(d0.decodes) == 4  # only the keyed requests reached an engine
            assert (await _call(url, "GET", "/v1/models", USER_KEY))[0] == 200
            status, _h, raw = await _call(url, "GET", "/conductor/state", USER_KEY)
            assert status == 403, raw
            assert json.loads(raw)["error"]["type"] == "permission_error"
            assert (await _call(url, "GET", f"/conductor/state?model={MODEL}",
                                ADMIN_KEY))[0] == 200
            assert (await _call(url, "POST", CMPL, ADMIN_KEY, _body()))[0] == 200
            metrics = (await _call(url, "GET", "/metrics", None))[2].decode()
            assert 'mooncake_gateway_auth_denied_total{code="invalid_api_key"}' in metrics
            assert 'mooncake_gateway_auth_denied_total{code="forbidden"} 1.0' in metrics

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    for key in (USER_KEY, ADMIN_KEY):
        assert key not in caplog.text


def test_a_key_over_its_limit_gets_429_before_any_engine_and_others_are_served(
        tmp_path: Path) -> None:
    users = _secret(tmp_path / "users", alice=USER_KEY, bob=OTHER_KEY)

    async def main() -> None:
        auth = {"keys_dir": str(users), "requests_per_minute": 3,
                "tokens_per_minute": 200}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], auth=auth) as gw:
            url = gw.url
            for stream in (False, True, False):
                assert (await _call(url, "POST", CMPL, USER_KEY, _body(stream)))[0] == 200
            served = len(d0.decodes)
            for stream in (False, True):
                status, headers, raw = await _call(url, "POST", CMPL, USER_KEY,
                                                   _body(stream))
                assert status == 429, raw
                err = json.loads(raw)["error"]
                assert (err["type"], err["code"]) == ("rate_limit_error",
                                                      "requests_limit_exceeded")
                assert int(headers["Retry-After"]) >= 1
            assert len(d0.decodes) == served  # refused before any engine call
            # bob is served meanwhile; his token budget is his own
            assert (await _call(url, "POST", CMPL, OTHER_KEY, _body(max_tokens=100)))[0] == 200
            status, headers, raw = await _call(url, "POST", CMPL, OTHER_KEY,
                                               _body(max_tokens=100))
            assert status == 429, raw  # 20 + 100 tokens again: over 200 a minute
            assert json.loads(raw)["error"]["code"] == "tokens_limit_exceeded"
            metrics = (await _call(url, "GET", "/metrics", None))[2].decode()
            assert (f'mooncake_gateway_requests_total{{endpoint="completions",model="{MODEL}",'
                    'outcome="limited"} 3.0') in metrics
            # a key's own limit is not the cluster's: no SLO miss, no scheduler rejection
            assert 'outcome="rejected"} 0.0' in metrics

    asyncio.run(main())


def test_the_operator_reads_the_registry_with_the_first_admin_key_rotated_live(
        tmp_path: Path) -> None:
    """The operator's client (``mooncake_operator.gatewayclient``) against a locked gateway:
    it sends the first admin key by file name, read again on every call."""
    from mooncake_operator.gatewayclient import GatewayClient as OperatorClient

    admins = _secret(tmp_path / "admins", a_operator=ADMIN_KEY, b_spare=OTHER_KEY)

    async def main() -> None:
        auth = {"admin_keys_dir": str(admins), "reload_s": 0.01}
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], auth=auth) as gw:
            locked_out = OperatorClient(gw.url, 5.0)
            client = OperatorClient(gw.url, 5.0, admins)
            try:
                assert await locked_out.registry(MODEL) is None  # 401: unknown, not empty
                got = await client.registry(MODEL)
                assert got is not None and len(got["models"]) == 1
                _secret(admins, a_operator="sk-rotated-1234567890")
                await asyncio.sleep(0.05)
                assert await client.registry(MODEL) is not None  # the new key, no restart
                assert await client.hot_prefixes(MODEL, 5) is not None
            finally:
                await client.close()
                await locked_out.close()

    asyncio.run(main())


def test_the_trace_replay_sends_its_key(tmp_path: Path) -> None:
    from mooncake_gateway.replay import ReplayConfig, ReplayError, replay
    from mooncake_sim.trace import TraceRecord

    admins = _secret(tmp_path / "admins", ops=ADMIN_KEY)
    records = [TraceRecord(timestamp_ms=i, input_length=40, output_length=3,
                           hash_ids=(i, 100 + i)) for i in range(3)]

    async def main() -> None:
        async with engines("p0", "d0") as (p0, d0), running_gateway(
                [model([p0], [d0])], auth={"admin_keys_dir": str(admins)}) as gw:
            got = await replay(records, ReplayConfig(url=gw.url, model=MODEL, speed=10.0,
                                                     api_key=ADMIN_KEY))
            assert (got["completed"], got["failed"]) == (3, 0)
            with pytest.raises(ReplayError, match=r"answered 401.*MOONCAKE_API_KEY"):
                await replay(records, ReplayConfig(url=gw.url, speed=10.0))

    asyncio.run(main())
