"""The names and ports components agree on: a change here is a wire change between the
operator, the gateway and the worker (and between versions during an upgrade)."""

from __future__ import annotations

from mooncake_contract import conventions as c


def test_pinned_values() -> None:
    assert (c.LABEL_CLUSTER, c.LABEL_ROLE, c.LABEL_REVISION) == (
        "mooncake.io/cluster", "mooncake.io/role", "mooncake.io/revision")
    assert c.ANNOTATION_DRAIN == "mooncake.io/drain"
    assert (c.ANNOTATION_HTTP_PORT, c.ANNOTATION_KV_EVENTS_PORT, c.ANNOTATION_KV_REPLAY_PORT,
            c.ANNOTATION_KV_TOPIC) == ("mooncake.io/http-port", "mooncake.io/kv-events-port",
                                       "mooncake.io/kv-replay-port", "mooncake.io/kv-topic")
    # vLLM's defaults for the KV-event sockets; mooncake_master's and mooncake_client's
    assert (c.PORT_KV_EVENTS, c.PORT_KV_REPLAY) == (5557, 5558)
    assert (c.PORT_STORE_RPC, c.PORT_STORE_METRICS, c.PORT_STORE_CLIENT) == (50051, 9003, 50052)


def test_every_label_and_annotation_is_a_valid_qualified_name() -> None:
    import re

    name = re.compile(r"^([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
    keys = [v for k, v in vars(c).items() if k.startswith(("LABEL_", "ANNOTATION_"))]
    assert keys and all(name.match(k) for k in keys)
    assert len(set(c.ROLES)) == len(c.ROLES)
