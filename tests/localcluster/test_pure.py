"""Pure pieces of the local cluster: PKI, manifests, $(VAR) expansion, pod specs."""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from mooncake_localcluster import certs, components, manifests, podnet, podspec, procs
from mooncake_localcluster.settings import LocalClusterSettings


def test_ca_signs_serving_and_client_certs() -> None:
    ca = certs.make_ca()
    ca_cert = ca.certificate()
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    serving = certs.issue_cert(
        ca, "kube-apiserver", dns_names=("localhost",), ip_addresses=("127.0.0.1",), server=True
    )
    cert = serving.certificate()
    cert.verify_directly_issued_by(ca_cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage

    admin = certs.issue_cert(ca, "admin", organizations=("system:masters",), client=True)
    subject = admin.certificate().subject
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    assert subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "admin"


def test_ensure_pki_is_created_once(tmp_path: Path) -> None:
    paths = certs.ensure_pki(tmp_path / "pki", "127.0.0.1")
    assert paths.complete()
    before = paths.ca_crt.read_bytes()
    certs.ensure_pki(tmp_path / "pki", "127.0.0.1")
    assert paths.ca_crt.read_bytes() == before
    assert paths.sa_key.stat().st_mode & 0o077 == 0


def test_gpu_nodes_default_pools() -> None:
    settings = LocalClusterSettings()
    every = manifests.all_nodes(settings)
    assert len(every) == 9
    cpu = [n for n in every if n["metadata"]["labels"]["mooncake.io/pool"] == "system"]
    assert len(cpu) == 1 and cpu[0]["spec"]["taints"] == []
    assert "nvidia.com/gpu" not in cpu[0]["status"]["capacity"]
    nodes = [n for n in every if n not in cpu]
    assert len(nodes) == 8
    pools = [n["metadata"]["labels"]["mooncake.io/pool"] for n in nodes]
    assert pools.count("prefill") == 4 and pools.count("decode") == 4
    cidrs = [n["spec"]["podCIDR"] for n in every]
    assert len(set(cidrs)) == 9
    for node in nodes:
        net = ipaddress.IPv4Network(node["spec"]["podCIDR"])
        assert net.subnet_of(ipaddress.IPv4Network("127.0.0.0/8"))
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        assert "node.kubernetes.io/instance-type" in node["metadata"]["labels"]
        taint = node["spec"]["taints"][0]
        assert taint == {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def test_node_counts_follow_settings() -> None:
    settings = LocalClusterSettings(prefill_nodes=1, decode_nodes=2, cpu_nodes=2)
    names = [name for name, _ in manifests.node_names(settings)]
    assert names == ["gpu-prefill-0", "gpu-decode-0", "gpu-decode-1", "cpu-0", "cpu-1"]


def test_kubeconfig_is_self_contained() -> None:
    cfg = manifests.kubeconfig("https://127.0.0.1:1234", b"ca", b"crt", b"key")
    text = yaml.safe_dump(cfg)
    loaded = yaml.safe_load(text)
    assert loaded["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:1234"
    assert loaded["current-context"] == manifests.KUBECONFIG_CONTEXT


def test_kwok_stages_parse_and_split_runnable_pods() -> None:
    settings = LocalClusterSettings()
    docs = list(yaml.safe_load_all(manifests.kwok_stages(settings)))
    names = [d["metadata"]["name"] for d in docs]
    assert names == [
        "node-initialize",
        "node-heartbeat",
        "pod-ready",
        "pod-ip-for-runner",
        "pod-complete",
        "pod-delete",
    ]
    runnable = manifests.runnable_jq(settings)
    exprs = {d["metadata"]["name"]: d["spec"]["selector"]["matchExpressions"] for d in docs}
    assert {"key": runnable, "operator": "In", "values": ["false"]} in exprs["pod-ready"]
    assert {"key": runnable, "operator": "In", "values": ["true"]} in exprs["pod-ip-for-runner"]
    # kwok deletes only the pods it fakes; the runner removes its own once stopped
    assert {"key": runnable, "operator": "In", "values": ["false"]} in exprs["pod-delete"]
    # Ready nodes keep heartbeating (else the node lifecycle controller marks them and their
    # pods NotReady after its grace period), well within that period
    beat = next(d for d in docs if d["metadata"]["name"] == "node-heartbeat")
    assert beat["spec"]["delay"]["jitterDurationMilliseconds"] < \
        settings.node_monitor_grace_s * 1000 / 3
    assert "lastHeartbeatTime: {{ $now" in beat["spec"]["next"]["statusTemplate"]


def test_kwok_config_runs_one_pod_stage_worker_before_its_stages() -> None:
    settings = LocalClusterSettings()
    first, *stages = yaml.safe_load_all(manifests.kwok_config(settings))
    assert first["kind"] == "KwokConfiguration"
    # one worker gives pod addresses (kwok v0.8.0 can make two pools for one podCIDR)
    assert first["options"]["podPlayStageParallelism"] == 1
    # read from a file, kwok defaults nothing: its defaults are written out
    assert first["options"]["cidr"] == "10.0.0.0/24"
    assert first["options"]["nodePlayStageParallelism"] == 4
    assert stages == list(yaml.safe_load_all(manifests.kwok_stages(settings)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--bind $(POD_IP)", "--bind 127.1.1.5"),
        ("$(POD_IP):$(PORT)", "127.1.1.5:8080"),
        ("$(UNKNOWN)", "$(UNKNOWN)"),
        ("$$(POD_IP)", "$(POD_IP)"),
        ("cost $5", "cost $5"),
        ("$(POD_IP", "$(POD_IP"),
        ("trailing $", "trailing $"),
        ("$$$(PORT)", "$8080"),
    ],
)
def test_expand(text: str, expected: str) -> None:
    assert podspec.expand(text, {"POD_IP": "127.1.1.5", "PORT": "8080"}) == expected


POD = {
    "metadata": {
        "name": "web",
        "namespace": "demo",
        "uid": "u-1",
        "labels": {"app": "web"},
        "annotations": {"mooncake.io/role": "prefill", "b": 'say "hi"'},
    },
    "spec": {"nodeName": "gpu-prefill-0"},
    "status": {"podIP": "127.1.1.7", "hostIP": "127.0.0.1"},
}


def test_field_refs() -> None:
    assert podspec.field_value(POD, "status.podIP") == "127.1.1.7"
    assert podspec.field_value(POD, "metadata.name") == "web"
    assert podspec.field_value(POD, "metadata.namespace") == "demo"
    assert podspec.field_value(POD, "metadata.annotations['mooncake.io/role']") == "prefill"
    assert podspec.field_value(POD, "metadata.labels['app']") == "web"
    assert podspec.field_value(POD, "metadata.labels['missing']") == ""
    assert podspec.field_value(POD, "spec.unknown") is None
    assert podspec.field_value(POD, "metadata.annotations") == (
        'b="say \\"hi\\""\nmooncake.io/role="prefill"'
    )


def test_container_env_and_process_spec() -> None:
    container = {
        "name": "main",
        "image": "ghcr.io/x/mooncake-operator:dev",
        "command": ["python", "-m", "http.server"],
        "args": ["--bind", "$(POD_IP)", "$(PORT)", "--directory", "/etc/podinfo"],
        "env": [
            {"name": "PORT", "value": "8080"},
            {"name": "URL", "value": "http://$(POD_IP):$(PORT)"},
            {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "ROLE",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['mooncake.io/role']"}
                },
            },
            {"name": "INFO", "value": "/etc/podinfo/annotations"},
            {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        ],
    }
    rewrites = [podspec.MountRewrite("/etc/podinfo", "/tmp/pods/x/podinfo")]
    spec = podspec.process_spec(
        POD, container, {"POD_IP": "127.1.1.7"}, rewrites, {"cm": {"k": "v"}}
    )
    assert spec.argv == [
        "python",
        "-m",
        "http.server",
        "--bind",
        "127.1.1.7",
        "8080",
        "--directory",
        "/tmp/pods/x/podinfo",
    ]
    assert spec.env["URL"] == "http://127.1.1.7:8080"
    assert spec.env["ME"] == "web"
    assert spec.env["ROLE"] == "prefill"
    assert spec.env["INFO"] == "/tmp/pods/x/podinfo/annotations"
    assert spec.env["CFG"] == "v"
    assert spec.env["POD_IP"] == "127.1.1.7"


def test_rewrite_paths_respects_boundaries() -> None:
    rewrites = [
        podspec.MountRewrite("/etc/cfg", "/L/cfg"),
        podspec.MountRewrite("/etc/cfg/deep", "/L/deep"),
    ]
    assert podspec.rewrite_paths("/etc/cfg/a.yaml", rewrites) == "/L/cfg/a.yaml"
    assert podspec.rewrite_paths("/etc/cfg/deep/b", rewrites) == "/L/deep/b"
    assert podspec.rewrite_paths("/etc/cfgx", rewrites) == "/etc/cfgx"
    assert podspec.rewrite_paths("--config=/etc/cfg", rewrites) == "--config=/L/cfg"
    # a ZeroMQ IPC endpoint names a path, also inside JSON; tcp:// and other URLs do not
    assert podspec.rewrite_paths("ipc:///etc/cfg/s", rewrites) == "ipc:///L/cfg/s"
    assert podspec.rewrite_paths('{"endpoint":"ipc:///etc/cfg/deep/s"}', rewrites) == \
        '{"endpoint":"ipc:///L/deep/s"}'
    assert podspec.rewrite_paths("http://h/etc/cfg/s", rewrites) == "http://h/etc/cfg/s"
    assert podspec.rewrite_paths("file:///etc/cfg/s", rewrites) == "file:///etc/cfg/s"


def test_rewrite_paths_once_even_when_a_local_dir_starts_with_a_mount_path() -> None:
    # A writable /tmp emptyDir (restricted pods with a read-only root) next to the
    # annotations mount, with the pod's local dirs under /tmp themselves.
    local = "/tmp/pytest-of-root/pytest-1/localcluster0/pods/e2e_p_1234/volumes"
    rewrites = [
        podspec.MountRewrite("/etc/mooncake/podinfo", f"{local}/podinfo"),
        podspec.MountRewrite("/tmp", f"{local}/tmp"),
    ]
    file = "/etc/mooncake/podinfo/annotations"
    assert podspec.rewrite_paths(file, rewrites) == f"{local}/podinfo/annotations"
    assert podspec.rewrite_paths("/tmp/x /var/tmp/y", rewrites) == f"{local}/tmp/x /var/tmp/y"
    container = {
        "command": ["app", "--annotations-file", file, "--scratch=$(SCRATCH)", "$(INFO)"],
        "env": [{"name": "INFO", "value": file}, {"name": "SCRATCH", "value": "/tmp"}],
    }
    spec = podspec.process_spec(POD, container, {}, rewrites)
    assert spec.argv == [
        "app", "--annotations-file", f"{local}/podinfo/annotations",
        f"--scratch={local}/tmp", f"{local}/podinfo/annotations",
    ]
    assert spec.env["INFO"] == f"{local}/podinfo/annotations"
    assert podspec.process_spec(POD, {"args": ["/tmp"]}, {}, rewrites, None, ["/tmp/run"]).argv == [
        f"{local}/tmp/run", f"{local}/tmp"
    ]


def test_downward_api_and_config_map_files() -> None:
    volume = {
        "name": "podinfo",
        "downwardAPI": {
            "items": [
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
            ]
        },
    }
    assert podspec.downward_api_files(POD, volume) == {"labels": 'app="web"', "name": "web"}
    cm_volume = {"name": "c", "configMap": {"name": "cm", "items": [{"key": "a", "path": "x/a"}]}}
    assert podspec.config_map_files(cm_volume, {"a": "1", "b": "2"}) == {"x/a": "1"}
    assert podspec.config_map_files({"configMap": {"name": "cm"}}, {"a": "1"}) == {"a": "1"}


def test_is_runnable() -> None:
    subs = ("mooncake-operator",)
    pod = {"metadata": {}, "spec": {"containers": [{"image": "ghcr.io/o/mooncake-operator:1"}]}}
    assert podspec.is_runnable(pod, subs, "mooncake.io/runnable")
    other = {"metadata": {}, "spec": {"containers": [{"image": "nginx"}]}}
    assert not podspec.is_runnable(other, subs, "mooncake.io/runnable")
    labelled = {
        "metadata": {"labels": {"mooncake.io/runnable": "true"}},
        "spec": {"containers": [{"image": "python:3.11"}]},
    }
    assert podspec.is_runnable(labelled, subs, "mooncake.io/runnable")


def test_module_versions_are_pinned_in_the_repo() -> None:
    tools = components.find_tools_dir(LocalClusterSettings())
    versions = {c.name: components.component_version(c, tools) for c in components.COMPONENTS}
    assert versions["kube-apiserver"].startswith("v1.3")
    assert versions["kube-apiserver"] == versions["kube-scheduler"]
    assert versions["etcd"].startswith("v3.6")
    for name in versions:
        assert (tools / name / "go.sum").is_file()


def test_module_version_parsing() -> None:
    gomod = "module x\n\nrequire (\n\tk8s.io/kubernetes v1.36.3\n\tfoo v1.0.0 // indirect\n)\n"
    assert components.module_version(gomod, "k8s.io/kubernetes") == "v1.36.3"
    assert components.module_version("require a.b/c v0.1.0\n", "a.b/c") == "v0.1.0"
    with pytest.raises(ValueError):
        components.module_version(gomod, "missing.example/mod")


def test_k8s_ldflags_set_versions() -> None:
    flags = components.component("kube-apiserver").ldflags("v1.36.3")
    assert "-X k8s.io/component-base/version.gitVersion=v1.36.3" in flags
    assert "-X k8s.io/component-base/version.gitMinor=36" in flags


def test_cli_registers_actions() -> None:
    import argparse

    from mooncake_localcluster import cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.register(sub)
    for action in ("build", "up", "down", "status", "kubeconfig"):
        args = parser.parse_args(["local-cluster", action])
        assert callable(args.handler)
    args = parser.parse_args(["local-cluster", "up", "--prefill-nodes", "2", "--name", "x"])
    settings = cli._settings(args)
    assert settings.prefill_nodes == 2 and settings.name == "x"
    assert settings.resolved_state_dir().name == "x"


def test_stop_record_stops_the_whole_group_after_exec(tmp_path: Path) -> None:
    from mooncake_localcluster import procs

    pid_dir = tmp_path / "pids"
    proc = procs.start(
        "grp", ["sh", "-c", "sleep 60 & exec sleep 61"], tmp_path / "grp.log", pid_dir
    )
    record = procs.PidRecord.read(pid_dir / f"grp{procs.PID_SUFFIX}")
    assert record is not None and record.start_time > 0
    deadline = time.monotonic() + 5
    while len(procs.group_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = procs.group_pids(proc.pid)
    assert len(members) == 2
    assert procs.alive(record)  # exec kept pid and start time
    assert procs.stop_record(record, pid_dir, timeout_s=5)
    proc.wait(timeout=5)
    assert all(procs.is_zombie(pid) for pid in members)
    assert procs.records(pid_dir) == []
    assert not procs.alive(record)


def test_rss_kib_reads_a_live_process_and_zero_for_a_gone_one() -> None:
    import os
    import subprocess

    from mooncake_localcluster.procs import rss_kib

    assert rss_kib(os.getpid()) > 1024  # this interpreter holds more than 1 MiB
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert rss_kib(gone.pid) == 0


def test_a_cold_start_returns_a_running_pods_address_and_makes_it_pending() -> None:
    pod = {"status": {
        "phase": "Running", "podIP": "127.1.3.1", "podIPs": [{"ip": "127.1.3.1"}],
        "hostIP": "127.0.0.2", "containerStatuses": [{"name": "c", "restartCount": 2}],
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "True"},
                       {"type": "ContainersReady", "status": "True"}]}}
    patch = podnet.reset_status(pod)
    assert patch is not None
    status = patch["status"]
    assert status["podIP"] is None and status["podIPs"] is None
    # Pending and no address is what kwok's pod-ready Stage selects on.
    assert status["phase"] == "Pending"
    assert status["conditions"] == [{"type": "PodScheduled", "status": "True"}]
    assert status["containerStatuses"] is None


def test_a_cold_start_leaves_a_finished_pods_phase_and_skips_pods_without_address() -> None:
    done = {"status": {"phase": "Succeeded", "podIP": "127.1.3.4"}}
    patch = podnet.reset_status(done)
    assert patch == {"status": {"podIP": None, "podIPs": None}}
    assert podnet.reset_status({"status": {"phase": "Pending"}}) is None
    assert podnet.reset_status({}) is None


LDCONFIG_LISTING = """3 libs found in cache `/etc/ld.so.cache'
\tlibibverbs.so.1.14 (libc6,x86-64) => /lib/x86_64-linux-gnu/libibverbs.so.1.14
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1
"""


def test_a_library_counts_as_installed_only_under_its_own_soname() -> None:
    assert procs.listed_by_ldconfig(LDCONFIG_LISTING, "libz.so.1")
    assert procs.listed_by_ldconfig(LDCONFIG_LISTING, "libc.so.6")
    # a longer version of the name, or the name inside a path, is another library
    assert not procs.listed_by_ldconfig(LDCONFIG_LISTING, procs.IBVERBS_SONAME)
    assert not procs.listed_by_ldconfig(LDCONFIG_LISTING + "\tlibibverbs.so.10 (libc6) => /x\n",
                                        procs.IBVERBS_SONAME)
    assert procs.listed_by_ldconfig(
        LDCONFIG_LISTING + f"\t{procs.IBVERBS_SONAME} (libc6,x86-64) => /lib/x\n",
        procs.IBVERBS_SONAME)
