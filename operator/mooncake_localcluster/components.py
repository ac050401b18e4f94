"""The Go components, their pinned versions (read from the wrapper go.mod) and builds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mooncake_localcluster import bindpin
from mooncake_localcluster.settings import LocalClusterSettings

TOOLS_SUBDIR = Path("tools") / "localcluster"
TOOLS_ENV = "MOONCAKE_LOCALCLUSTER_TOOLS_DIR"
ZERO_COMMIT = "0" * 40
BUILD_DATE = "2026-01-01T00:00:00Z"
PROGRESS_EVERY = 50  # print a progress line every this many compiled packages


@dataclass(frozen=True)
class Component:
    """One binary built from one wrapper module ``tools/localcluster/<name>``."""

    name: str
    package: str
    version_module: str
    ldflags: Callable[[str], list[str]]


def _k8s_ldflags(version: str) -> list[str]:
    major, minor = version.lstrip("v").split(".")[:2]
    flags: list[str] = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.gitCommit={ZERO_COMMIT}",
            f"-X {pkg}.buildDate={BUILD_DATE}",
        ]
    return flags


def _etcd_ldflags(version: str) -> list[str]:
    return [f"-X go.etcd.io/etcd/api/v3/version.GitSHA={version}"]


def _kwok_ldflags(version: str) -> list[str]:
    return []


HELM_K8S_MINOR = "37"  # helm v3.22 is built against client-go v0.37


def _helm_ldflags(version: str) -> list[str]:
    flags = [
        f"-X helm.sh/helm/v3/internal/version.version={version}",
        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
    ]
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        flags += [f"-X {pkg}.k8sVersionMajor=1", f"-X {pkg}.k8sVersionMinor={HELM_K8S_MINOR}"]
    return flags


K8S = "k8s.io/kubernetes"
COMPONENTS: tuple[Component, ...] = (
    Component("etcd", "go.etcd.io/etcd/server/v3", "go.etcd.io/etcd/server/v3", _etcd_ldflags),
    Component("kube-apiserver", f"{K8S}/cmd/kube-apiserver", K8S, _k8s_ldflags),
    Component("kube-controller-manager", f"{K8S}/cmd/kube-controller-manager", K8S, _k8s_ldflags),
    Component("kube-scheduler", f"{K8S}/cmd/kube-scheduler", K8S, _k8s_ldflags),
    Component("kwok", "sigs.k8s.io/kwok/cmd/kwok", "sigs.k8s.io/kwok", _kwok_ldflags),
    Component("helm", "helm.sh/helm/v3/cmd/helm", "helm.sh/helm/v3", _helm_ldflags),
)
RUNTIME_COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def component(name: str) -> Component:
    for comp in COMPONENTS:
        if comp.name == name:
            return comp
    raise KeyError(name)


def find_tools_dir(settings: LocalClusterSettings) -> Path:
    """The wrapper modules: settings/env override, else walk up from this file to the repo."""
    if settings.tools_dir is not None:
        return settings.tools_dir
    env = os.environ.get(TOOLS_ENV)
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        candidate = parent / TOOLS_SUBDIR
        if (candidate / "kube-apiserver" / "go.mod").is_file():
            return candidate
    raise FileNotFoundError(
        f"cannot find {TOOLS_SUBDIR} above {__file__}; set {TOOLS_ENV} to the wrapper modules"
    )


def module_version(go_mod: str, module: str) -> str:
    """The version a go.mod ``require``s for ``module`` (single line or block form)."""
    pattern = rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)"
    match = re.search(pattern, go_mod, re.M)
    if match is None:
        raise ValueError(f"{module} is not required in go.mod")
    return match.group(1)


def component_version(comp: Component, tools_dir: Path) -> str:
    return module_version((tools_dir / comp.name / "go.mod").read_text(), comp.version_module)


def binary_path(settings: LocalClusterSettings, comp: Component, tools_dir: Path) -> Path:
    version = component_version(comp, tools_dir)
    return settings.binary_dir(comp.name, version) / comp.name


def build_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CGO_ENABLED"] = "0"
    env["GOFLAGS"] = "-mod=mod"
    return env


def build_component(
    settings: LocalClusterSettings,
    comp: Component,
    tools_dir: Path,
    log: Callable[[str], None] = print,
) -> Path:
    """Build one binary into its versioned cache dir unless it is already there."""
    version = component_version(comp, tools_dir)
    out = settings.binary_dir(comp.name, version) / comp.name
    if out.is_file() and os.access(out, os.X_OK):
        log(f"[cached] {comp.name} {version}: {out}")
        return out
    if shutil.which(settings.go) is None:
        raise FileNotFoundError(f"Go toolchain {settings.go!r} not found on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    ldflags = " ".join(["-s", "-w", *comp.ldflags(version)])
    cmd = [settings.go, "build", "-v", "-trimpath", "-ldflags", ldflags, "-o", str(tmp)]
    cmd.append(comp.package)
    log(f"[build] {comp.name} {version} (go build {comp.package}) ...")
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=tools_dir / comp.name,
        env=build_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for count, line in enumerate(proc.stdout, start=1):
        tail = [*tail[-40:], line.rstrip()]
        if count % PROGRESS_EVERY == 0:
            elapsed = time.monotonic() - started
            log(f"  {comp.name}: {count} packages compiled ({elapsed:.0f}s)")
    if proc.wait() != 0:
        raise RuntimeError(f"building {comp.name} failed:\n" + "\n".join(tail))
    tmp.replace(out)
    log(f"[done] {comp.name} {version} in {time.monotonic() - started:.0f}s -> {out}")
    return out


def build_all(
    settings: LocalClusterSettings,
    names: tuple[str, ...] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Path]:
    tools_dir = find_tools_dir(settings)
    wanted = names or tuple(c.name for c in COMPONENTS)
    started = time.monotonic()
    paths = {name: build_component(settings, component(name), tools_dir, log) for name in wanted}
    if names is None or set(RUNTIME_COMPONENTS) <= set(names):
        # what runs a cluster: also the pods' bind pin (C, seconds)
        pin = bindpin.build(settings, log)
        if pin is not None:
            paths["bindpin"] = pin
    log(f"all binaries ready in {time.monotonic() - started:.0f}s")
    sys.stdout.flush()
    return paths
