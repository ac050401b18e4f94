"""Pure Service pieces: the kubelet's Service variables, entrypoints, proxy routing,
the atomic volume writer. No cluster needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from mooncake_localcluster import cluster, podrunner, podspec, serviceproxy, services, volumes
from mooncake_localcluster.settings import LocalClusterSettings
from pydantic import ValidationError


def _service(
    name: str, ip: str, ports: list[dict[str, Any]], namespace: str = "demo", **spec: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": ip, "ports": ports, **spec},
    }


# What the kubelet (pkg/kubelet/envvars.FromServices) makes, in its order.
TWO_NAMED_PORTS = [
    ("STORE_MASTER_SERVICE_HOST", "127.96.0.20"),
    ("STORE_MASTER_SERVICE_PORT", "50051"),
    ("STORE_MASTER_SERVICE_PORT_RPC", "50051"),
    ("STORE_MASTER_SERVICE_PORT_HTTP_METADATA", "8080"),
    ("STORE_MASTER_PORT", "tcp://127.96.0.20:50051"),
    ("STORE_MASTER_PORT_50051_TCP", "tcp://127.96.0.20:50051"),
    ("STORE_MASTER_PORT_50051_TCP_PROTO", "tcp"),
    ("STORE_MASTER_PORT_50051_TCP_PORT", "50051"),
    ("STORE_MASTER_PORT_50051_TCP_ADDR", "127.96.0.20"),
    ("STORE_MASTER_PORT_8080_TCP", "tcp://127.96.0.20:8080"),
    ("STORE_MASTER_PORT_8080_TCP_PROTO", "tcp"),
    ("STORE_MASTER_PORT_8080_TCP_PORT", "8080"),
    ("STORE_MASTER_PORT_8080_TCP_ADDR", "127.96.0.20"),
]


def test_service_env_two_named_ports_golden() -> None:
    svc = _service(
        "store-master",
        "127.96.0.20",
        [
            {"name": "rpc", "port": 50051, "protocol": "TCP", "targetPort": "rpc"},
            {"name": "http-metadata", "port": 8080, "targetPort": 8080},
        ],
    )
    assert list(services.service_env([svc]).items()) == TWO_NAMED_PORTS


def test_service_env_protocols_unnamed_first_port_and_ipv6() -> None:
    # The kubelet's own test vectors for these shapes.
    udp_first = _service(
        "abc-123",
        "5.6.7.8",
        [
            {"name": "u-d-p", "port": 8081, "protocol": "UDP"},
            {"name": "t-c-p", "port": 8081, "protocol": "TCP"},
        ],
    )
    env = services.service_env([udp_first])
    assert env["ABC_123_SERVICE_PORT_U_D_P"] == "8081"
    assert env["ABC_123_SERVICE_PORT_T_C_P"] == "8081"
    assert env["ABC_123_PORT"] == "udp://5.6.7.8:8081"
    assert env["ABC_123_PORT_8081_UDP_PROTO"] == "udp"
    assert env["ABC_123_PORT_8081_TCP"] == "tcp://5.6.7.8:8081"
    unnamed = _service("q-u-u-x", "9.8.7.6", [{"port": 8082}, {"name": "8083", "port": 8083}])
    env = services.service_env([unnamed])
    assert env["Q_U_U_X_SERVICE_PORT"] == "8082"
    assert env["Q_U_U_X_SERVICE_PORT_8083"] == "8083"
    assert not [k for k in env if k.endswith("_")]  # the unnamed first port adds no name
    assert len(env) == 12
    v6 = _service("super-ipv6", "2001:DB8::", [{"name": "t", "port": 8084}])
    assert services.service_env([v6])["SUPER_IPV6_PORT"] == "tcp://[2001:DB8::]:8084"


def test_headless_and_ipless_services_get_no_variables() -> None:
    headless = _service("h", "None", [{"port": 80}])
    external = {"metadata": {"name": "ext", "namespace": "demo"}, "spec": {"type": "ExternalName"}}
    empty = _service("e", "", [{"port": 80}])
    assert services.service_env([headless, external, empty]) == {}


def test_pod_sees_its_namespace_and_always_kubernetes() -> None:
    master = _service(
        "kubernetes", "127.96.0.1", [{"name": "https", "port": 443}], namespace="default"
    )
    mine = _service("web", "127.96.0.9", [{"port": 80}])
    other = _service("elsewhere", "127.96.0.8", [{"port": 80}], namespace="other")
    every = [master, mine, other]
    env = services.pod_service_env("demo", True, every)
    assert env["KUBERNETES_SERVICE_HOST"] == "127.96.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == "443"
    assert env["KUBERNETES_SERVICE_PORT_HTTPS"] == "443"
    assert env["KUBERNETES_PORT_443_TCP_ADDR"] == "127.96.0.1"
    assert env["WEB_SERVICE_HOST"] == "127.96.0.9"
    assert not any(k.startswith("ELSEWHERE_") for k in env)
    # enableServiceLinks: false keeps only the kubernetes Service.
    no_links = services.pod_service_env("demo", False, every)
    assert no_links == services.service_env([master])
    # Pods in `default` see every Service there, once.
    assert services.pod_service_env("default", True, every) == services.service_env([master])
    # A `kubernetes` Service of the pod's own namespace wins, in either order.
    own = _service("kubernetes", "127.96.0.50", [{"port": 6443}])
    for order in ([master, own], [own, master]):
        assert services.pod_service_env("demo", True, order)["KUBERNETES_SERVICE_HOST"] == (
            "127.96.0.50"
        )


def test_service_variables_expand_in_args_and_env() -> None:
    implicit = services.service_env([_service("my-svc", "127.96.0.7", [{"port": 9000}])])
    container = {
        "name": "c",
        "command": ["client"],
        "args": ["--master=$(MY_SVC_SERVICE_HOST):$(MY_SVC_SERVICE_PORT)"],
        "env": [
            {"name": "URL", "value": "http://$(MY_SVC_SERVICE_HOST)"},
            {"name": "MY_SVC_SERVICE_PORT", "value": "1"},  # container env wins
        ],
    }
    spec = podspec.process_spec({"metadata": {}}, container, implicit, [])
    assert spec.argv == ["client", "--master=127.96.0.7:1"]
    assert spec.env["URL"] == "http://127.96.0.7"
    assert spec.env["MY_SVC_PORT_9000_TCP_ADDR"] == "127.96.0.7"


ENTRYPOINTS = {"mooncake-operator": ["mooncake-operator"], "mooncake-store": ["store", "-x"]}


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("ghcr.io/o/mooncake-operator:dev", ["mooncake-operator"]),
        ("ghcr.io/o/mooncake-store:1", ["store", "-x"]),
        ("busybox", None),
    ],
)
def test_image_entrypoint(image: str, expected: list[str] | None) -> None:
    assert podspec.image_entrypoint(image, ENTRYPOINTS) == expected


def test_longest_entrypoint_match_wins() -> None:
    table = {"mooncake": ["a"], "mooncake-operator": ["b"]}
    assert podspec.image_entrypoint("x/mooncake-operator:1", table) == ["b"]


def test_command_replaces_entrypoint_and_args_follow_it() -> None:
    pod: dict[str, Any] = {"metadata": {}}
    implicit = {"POD_IP": "127.1.1.2"}
    entry = ["mooncake-operator"]
    only_args = {"name": "c", "args": ["worker", "--host", "$(POD_IP)"]}
    spec = podspec.process_spec(pod, only_args, implicit, [], entrypoint=entry)
    assert spec.argv == ["mooncake-operator", "worker", "--host", "127.1.1.2"]
    with_command = {"name": "c", "command": ["python"], "args": ["-V"]}
    assert podspec.process_spec(pod, with_command, implicit, [], entrypoint=entry).argv == [
        "python",
        "-V",
    ]
    # No command and no known entrypoint: nothing to run (the runner reports exit 127).
    assert podspec.process_spec(pod, only_args, implicit, []).argv == []
    assert podspec.process_spec(pod, {"name": "c"}, implicit, [], entrypoint=entry).argv == entry


def test_settings_default_entrypoints_and_loopback_ranges() -> None:
    settings = LocalClusterSettings()
    assert settings.image_entrypoints == {"mooncake-operator": ["mooncake-operator"]}
    assert settings.service_range() == "127.96.0.0/16"
    assert settings.pod_prefix() == "127.1"
    assert settings.kubernetes_service_ip() == "127.96.0.1"
    slot = settings.with_slot(3)
    assert (slot.network_slot, slot.service_cidr, slot.pod_cidr_prefix) == (
        3,
        "127.99.0.0/16",
        "127.4",
    )
    explicit = LocalClusterSettings(service_cidr="127.200.0.0/16").with_slot(2)
    assert explicit.service_cidr == "127.200.0.0/16" and explicit.pod_cidr_prefix == "127.3"
    for bad in ("10.96.0.0/16", "127.0.0.0/8", "192.168.0.0/24"):
        with pytest.raises(ValidationError):
            LocalClusterSettings(service_cidr=bad)
    assert LocalClusterSettings(service_cidr="127.96.0.0/12").service_range() == "127.96.0.0/12"
    with pytest.raises(ValidationError):
        LocalClusterSettings(pod_cidr_prefix="10.1")


def _pod(
    name: str,
    ip: str,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    namespace: str = "demo",
    **meta: Any,
) -> services.PodView:
    return services.pod_view(
        {
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {"app": "w"}}
            | meta,
            "spec": {
                "containers": [{"ports": [{"name": "http", "containerPort": 8000}]}],
            },
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }
    )


def test_backends_are_ready_matching_pods_at_the_target_port() -> None:
    svc = _service("w", "127.96.0.5", [{"port": 80, "targetPort": "http"}], selector={"app": "w"})
    pods = [
        _pod("b", "127.1.1.3"),
        _pod("a", "127.1.1.2"),
        _pod("unready", "127.1.1.4", ready=False),
        _pod("terminating", "127.1.1.5", deletionTimestamp="2026-01-01T00:00:00Z"),
        _pod("other-app", "127.1.1.6", labels={"app": "x"}),
        _pod("other-ns", "127.1.1.7", namespace="else"),
        _pod("no-ip", ""),
        _pod("not-loopback", "10.0.0.8"),
    ]
    port = svc["spec"]["ports"][0]
    assert services.backends(svc, port, pods) == [("127.1.1.2", 8000), ("127.1.1.3", 8000)]
    numeric = {"port": 80, "targetPort": 9000}
    assert services.backends(svc, numeric, pods[:1]) == [("127.1.1.3", 9000)]
    assert services.backends(svc, {"port": 80}, pods[:1]) == [("127.1.1.3", 80)]
    assert services.backends(svc, {"port": 80, "targetPort": "grpc"}, pods[:1]) == []


def test_routes_cover_selector_services_and_the_apiserver() -> None:
    apiserver = ("127.0.0.1", 6443)
    master = _service(
        "kubernetes", "127.96.0.1", [{"name": "https", "port": 443}], namespace="default"
    )
    web = _service(
        "web",
        "127.96.0.9",
        [{"port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "m", "port": 9}],
        selector={"app": "w"},
    )
    headless = _service("h", "None", [{"port": 80}], selector={"app": "w"})
    no_selector = _service("manual", "127.96.0.10", [{"port": 80}])
    outside = _service("far", "10.96.0.7", [{"port": 80}], selector={"app": "w"})
    routes = serviceproxy.desired_routes([master, web, headless, no_selector, outside], apiserver)
    assert set(routes) == {("127.96.0.1", 443), ("127.96.0.9", 80), ("127.96.0.9", 9)}
    assert routes[("127.96.0.1", 443)].fixed == apiserver
    assert routes[("127.96.0.9", 80)].service == ("demo", "web")


def test_round_robin_rotation() -> None:
    pool = [("127.1.1.1", 1), ("127.1.1.2", 1), ("127.1.1.3", 1)]
    firsts = [serviceproxy.rotate(pool, n)[0] for n in range(4)]
    assert firsts == [pool[0], pool[1], pool[2], pool[0]]
    assert sorted(serviceproxy.rotate(pool, 1)) == pool
    assert serviceproxy.rotate([], 3) == []


def test_proxy_candidates_follow_pod_readiness() -> None:
    settings = LocalClusterSettings()
    proxy = serviceproxy.ServiceProxy(settings, None, ("127.0.0.1", 6443))  # type: ignore[arg-type]
    svc = _service("w", "127.96.0.5", [{"port": 80, "targetPort": 8080}], selector={"app": "w"})
    proxy.on_event(serviceproxy.SERVICES, "SYNC", {"items": [svc]})
    proxy.routes = serviceproxy.desired_routes([svc], proxy.apiserver)

    def pod(uid: str, ip: str, ready: bool) -> dict[str, Any]:
        return {
            "metadata": {"uid": uid, "name": uid, "namespace": "demo", "labels": {"app": "w"}},
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    proxy.on_event(serviceproxy.PODS, "SYNC", {"items": [pod("a", "127.1.1.2", True)]})
    proxy.on_event(serviceproxy.PODS, "ADDED", pod("b", "127.1.1.3", True))
    address = ("127.96.0.5", 80)
    picks = [proxy.candidates(address)[0][0] for _ in range(4)]
    assert picks == ["127.1.1.2", "127.1.1.3", "127.1.1.2", "127.1.1.3"]
    proxy.on_event(serviceproxy.PODS, "MODIFIED", pod("a", "127.1.1.2", False))
    assert proxy.candidates(address) == [("127.1.1.3", 8080)]
    proxy.on_event(serviceproxy.PODS, "DELETED", pod("b", "127.1.1.3", True))
    assert proxy.candidates(address) == []
    assert proxy.candidates(("127.96.0.99", 80)) == []


def _visible(directory: Path) -> dict[str, str]:
    return {
        p.name: p.read_text()
        for p in sorted(directory.iterdir())
        if not p.name.startswith("..") and p.is_file()
    }


def test_volume_writer_swaps_data_atomically(tmp_path: Path) -> None:
    vol = tmp_path / "cfg"
    assert volumes.write_volume(vol, {"a": "1", "sub/b": b"2"})
    assert _visible(vol) == {"a": "1"}
    assert (vol / "sub" / "b").read_text() == "2"
    assert os.readlink(vol / "a") == "..data/a"
    first = os.readlink(vol / "..data")
    assert not volumes.write_volume(vol, {"a": "1", "sub/b": "2"})  # unchanged: no rewrite
    assert os.readlink(vol / "..data") == first
    (vol / "nested").symlink_to(tmp_path)  # e.g. a nested mount: not the writer's
    assert volumes.write_volume(vol, {"a": "one"})
    assert (vol / "a").read_text() == "one"
    assert not (vol / "sub").exists()
    assert (vol / "nested").is_symlink()
    assert not (vol / first).exists()
    assert {p.name for p in vol.iterdir() if p.name.startswith("..")} == {
        "..data",
        os.readlink(vol / "..data"),
    }
    with pytest.raises(ValueError):
        volumes.write_volume(vol, {"../escape": "x"})


def test_downward_api_annotations_use_go_quoting() -> None:
    values = {"b": 'say "hi"\n\ttab', "a": "caf\u00e9 \x01", "z": "back\\slash"}
    assert podspec.format_map(values) == (
        'a="caf\u00e9 \\x01"\nb="say \\"hi\\"\\n\\ttab"\nz="back\\\\slash"'
    )


def test_network_slots_are_claimed_host_wide(tmp_path: Path) -> None:
    a = LocalClusterSettings(state_dir=tmp_path / "a")
    first, held = cluster.resolve_network(a, cluster.state_paths(a))
    try:
        b = LocalClusterSettings(state_dir=tmp_path / "b")
        second, held_b = cluster.resolve_network(b, cluster.state_paths(b))
        for sock in held_b:
            sock.close()
        assert first.network_slot is not None and second.network_slot is not None
        assert second.network_slot > first.network_slot
        assert second.service_cidr != first.service_cidr
        assert second.pod_cidr_prefix != first.pod_cidr_prefix
        taken = LocalClusterSettings(state_dir=tmp_path / "c", network_slot=first.network_slot)
        with pytest.raises(RuntimeError, match="hold"):
            cluster.resolve_network(taken, cluster.state_paths(taken))
    finally:
        for sock in held:
            sock.close()


def test_a_restart_keeps_the_recorded_ranges(tmp_path: Path) -> None:
    settings = LocalClusterSettings(state_dir=tmp_path)
    paths = cluster.state_paths(settings)
    paths.etcd_data.mkdir(parents=True)
    # State from before loopback Services: its objects carry 10.96 ClusterIPs.
    paths.settings_json.write_text('{"service_cidr": "10.96.0.0/16", "pod_cidr_prefix": "127.1"}')
    with pytest.raises(RuntimeError, match="down --purge"):
        cluster.resolve_network(settings, paths)
    paths.settings_json.write_text(settings.with_slot(5).model_dump_json())
    resolved, held = cluster.resolve_network(settings, paths)
    for sock in held:
        sock.close()
    assert resolved.network_slot == 5 and resolved.service_cidr == "127.101.0.0/16"
    other = LocalClusterSettings(state_dir=tmp_path, service_cidr="127.96.0.0/16")
    with pytest.raises(RuntimeError, match="service_cidr"):
        cluster.resolve_network(other, paths)


def test_serving_cert_gains_the_kubernetes_service_ip(tmp_path: Path) -> None:
    from mooncake_localcluster import certs

    pki = certs.ensure_pki(tmp_path / "pki", "127.0.0.1")
    ca = pki.ca_crt.read_bytes()
    assert certs._serving_ips(pki.serving_crt) == {"127.0.0.1"}
    certs.ensure_pki(tmp_path / "pki", "127.0.0.1", ("127.96.0.1",))
    assert certs._serving_ips(pki.serving_crt) == {"127.0.0.1", "127.96.0.1"}
    assert pki.ca_crt.read_bytes() == ca  # same CA: kubeconfigs stay valid


def test_config_map_and_secret_volume_files() -> None:
    cm = {"data": {"a": "1", "b": "2"}, "binaryData": {"bin": "AAE="}}
    cm_volume = {"name": "c", "configMap": {"name": "cm", "items": [{"key": "a", "path": "x/a"}]}}
    assert podrunner.volume_ref(cm_volume) == ("configmaps", "cm")
    assert podrunner.source_files(cm_volume, "configmaps", cm) == {"x/a": b"1"}
    whole = {"name": "c", "configMap": {"name": "cm"}}
    assert podrunner.source_files(whole, "configmaps", cm)["bin"] == b"\x00\x01"
    secret = {"data": {"token": "c2VjcmV0"}}
    s_volume = {"name": "s", "secret": {"secretName": "creds"}}
    assert podrunner.volume_ref(s_volume) == ("secrets", "creds")
    assert podrunner.source_files(s_volume, "secrets", secret) == {"token": b"secret"}
    assert podrunner.source_files(s_volume, "secrets", {}) == {}
    assert podrunner.volume_ref({"name": "e", "emptyDir": {}}) is None
