"""The Pod Security Standards' ``restricted`` profile as a pure check of a pod spec.

After https://kubernetes.io/docs/concepts/security/pod-security-standards/ (profile
version "latest"): every baseline control, then the restricted ones. Each violation names
the field. The API server's own admission (``pod-security.kubernetes.io/enforce:
restricted``) is the authority; ``test_chart_cluster.py`` checks that it agrees on the
chart's and the operator's pods.
"""

from __future__ import annotations

from typing import Any

JsonDict = dict[str, Any]

#: restricted: the only volume types allowed
ALLOWED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                             "persistentVolumeClaim", "projected", "secret"})
#: restricted: the only capability a container may add
ALLOWED_ADD = frozenset({"NET_BIND_SERVICE"})
#: baseline: sysctls a pod may set
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})
SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_OK = frozenset({"RuntimeDefault", "Localhost"})
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def pod_spec_of(obj: JsonDict) -> JsonDict:
    """The pod spec of a Pod or of a workload's pod template."""
    if obj.get("kind") == "Pod":
        return dict(obj["spec"])
    return dict(obj["spec"]["template"]["spec"])


def restricted_violations(spec: JsonDict) -> list[str]:
    """Every way ``spec`` (a PodSpec) breaks ``restricted``; empty when it meets it."""
    out: list[str] = []
    psc: JsonDict = spec.get("securityContext") or {}
    containers = [(f"{lst}[{c.get('name', i)}]", c)
                  for lst in CONTAINER_LISTS for i, c in enumerate(spec.get(lst) or [])]

    # -- baseline ------------------------------------------------------------------------------
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"spec.{field}: must be unset or false")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext.windowsOptions.hostProcess: must be unset or false")
    for v in spec.get("volumes") or []:
        kinds = [k for k in v if k != "name"]
        if "hostPath" in kinds:
            out.append(f"spec.volumes[{v.get('name')}].hostPath: not allowed")
        bad = [k for k in kinds if k not in ALLOWED_VOLUMES and k != "hostPath"]
        if bad:
            out.append(f"spec.volumes[{v.get('name')}]: volume type {bad[0]} not allowed")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext.sysctls[{s.get('name')}]: not a safe sysctl")
    out += _selinux("spec.securityContext", psc)
    out += _apparmor("spec.securityContext", psc)
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
        out.append(f"spec.securityContext.seccompProfile.type: {pod_seccomp} not allowed")
    # -- restricted, pod level -----------------------------------------------------------------
    if psc.get("runAsUser") == 0:
        out.append("spec.securityContext.runAsUser: must not be 0")
    if psc.get("runAsNonRoot") is False:
        out.append("spec.securityContext.runAsNonRoot: must not be false")

    for where, c in containers:
        sc: JsonDict = c.get("securityContext") or {}
        p = f"spec.{where}"
        if sc.get("privileged"):
            out.append(f"{p}.securityContext.privileged: must be unset or false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{p}.securityContext.windowsOptions.hostProcess: must be unset or false")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{p}.ports[{port.get('name', port.get('containerPort'))}].hostPort: "
                           "must be unset or 0")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{p}.securityContext.procMount: must be Default")
        out += _selinux(f"{p}.securityContext", sc)
        out += _apparmor(f"{p}.securityContext", sc)
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{p}.securityContext.allowPrivilegeEscalation: must be false")
        if sc.get("runAsNonRoot") is False:
            out.append(f"{p}.securityContext.runAsNonRoot: must not be false")
        elif sc.get("runAsNonRoot") is not True and psc.get("runAsNonRoot") is not True:
            out.append(f"{p}.securityContext.runAsNonRoot: must be true (here or on the pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"{p}.securityContext.runAsUser: must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in SECCOMP_OK:
            out.append(f"{p}.securityContext.seccompProfile.type: {seccomp} not allowed")
        elif seccomp is None and pod_seccomp is None:
            out.append(f"{p}.securityContext.seccompProfile.type: must be RuntimeDefault or "
                       "Localhost (here or on the pod)")
        caps: JsonDict = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{p}.securityContext.capabilities.drop: must include ALL")
        for cap in caps.get("add") or []:
            if cap not in ALLOWED_ADD:
                out.append(f"{p}.securityContext.capabilities.add: {cap} not allowed")
    return out


def _selinux(where: str, sc: JsonDict) -> list[str]:
    opts: JsonDict = sc.get("seLinuxOptions") or {}
    out = []
    if opts.get("type", "") not in SELINUX_TYPES:
        out.append(f"{where}.seLinuxOptions.type: {opts.get('type')} not allowed")
    for field in ("user", "role"):
        if opts.get(field):
            out.append(f"{where}.seLinuxOptions.{field}: must be unset")
    return out


def _apparmor(where: str, sc: JsonDict) -> list[str]:
    kind = (sc.get("appArmorProfile") or {}).get("type")
    if kind is not None and kind not in APPARMOR_OK:
        return [f"{where}.appArmorProfile.type: {kind} not allowed"]
    return []
