"""Pure helpers that turn a Pod's container spec into a local process description.

Kubernetes ``$(VAR)`` expansion, ``valueFrom.fieldRef`` resolution, downward-API,
configMap and secret file contents, the image entrypoint of a container without
``command`` and the rewrite of volume mount paths to per-pod local directories.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mooncake_contract.annotations import go_quote

JsonDict = dict[str, Any]
V = TypeVar("V")

_FIELD_SUBSCRIPT = re.compile(r"^metadata\.(annotations|labels)\['(.+)'\]$")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Expand ``$(VAR)`` like the kubelet: ``$$`` escapes, unknown references stay verbatim."""
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close == -1:
                out.append(text[i:])
                break
            name = text[i + 2 : close]
            if name in env:
                out.append(env[name])
            else:
                out.append(text[i : close + 1])
            i = close + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def field_value(pod: JsonDict, path: str) -> str | None:
    """Resolve a downward-API ``fieldPath`` against a pod object (None if unsupported)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        value = simple[path]
        return "" if value is None else str(value)
    match = _FIELD_SUBSCRIPT.match(path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    if path in ("metadata.annotations", "metadata.labels"):
        return format_map(meta.get(path.split(".")[1]) or {})
    return None


def format_map(values: Mapping[str, str]) -> str:
    """The downward-API file format for labels/annotations, as the kubelet writes it:
    sorted ``key=<Go strconv.Quote of value>`` lines, no newline after the last."""
    return "\n".join(f"{key}={go_quote(values[key])}" for key in sorted(values))


def container_env(
    pod: JsonDict,
    container: JsonDict,
    implicit: Mapping[str, str],
    config_maps: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, str]:
    """The container's environment in declaration order, with ``$(VAR)`` expanded.

    ``implicit`` (e.g. POD_IP) comes first so container env can refer to and override it.
    """
    env = dict(implicit)
    maps = config_maps or {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref:
            prefix = source.get("prefix", "")
            for key, value in (maps.get(ref.get("name", "")) or {}).items():
                env[prefix + key] = value
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(str(var["value"]), env)
            continue
        value_from = var.get("valueFrom") or {}
        resolved: str | None = None
        if "fieldRef" in value_from:
            resolved = field_value(pod, value_from["fieldRef"].get("fieldPath", ""))
        elif "configMapKeyRef" in value_from:
            ref = value_from["configMapKeyRef"]
            resolved = (maps.get(ref.get("name", "")) or {}).get(ref.get("key", ""))
        elif "value" not in var and not value_from:
            resolved = ""
        if resolved is not None:
            env[name] = resolved
    return env


@dataclass(frozen=True)
class MountRewrite:
    """Occurrences of ``mount_path`` in command/args/env become ``local_dir``."""

    mount_path: str
    local_dir: str


def rewrite_paths(text: str, rewrites: list[MountRewrite]) -> str:
    """Each mount path in ``text`` -> its local directory, in one pass.

    A mount path counts where it is a whole path: not preceded by a path character (so
    ``/var/tmp`` is no ``/tmp``), or right after ``ipc://`` (a ZeroMQ IPC endpoint names a
    path: ``ipc:///tmp/x``), and followed by ``/``, the end or a separator. The
    longest mount path wins, and replaced text is never scanned again, so a local
    directory that itself starts with a mount path (``/tmp/...`` with a ``/tmp`` mount)
    stays as it is.
    """
    by_path = {rw.mount_path.rstrip("/"): rw.local_dir for rw in rewrites}
    by_path.pop("", None)
    if not by_path:
        return text
    alternatives = "|".join(re.escape(p) for p in sorted(by_path, key=len, reverse=True))
    pattern = r"(?:(?<=ipc://)|(?<![\w.~/-]))(" + alternatives + r")(?=/|$|[\s:;,=\"'])"
    return re.sub(pattern, lambda m: by_path[m.group(1)], text)


@dataclass
class ProcessSpec:
    """What the pod runner executes for one container."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    rewrites: list[MountRewrite] = field(default_factory=list)


def image_entrypoint(image: str, entrypoints: Mapping[str, Sequence[str]]) -> list[str] | None:
    """The ENTRYPOINT of ``image`` from the table (the longest matching substring wins)."""
    matches = [sub for sub in entrypoints if sub and sub in image]
    if not matches:
        return None
    return list(entrypoints[max(matches, key=len)])


def process_spec(
    pod: JsonDict,
    container: JsonDict,
    implicit: Mapping[str, str],
    rewrites: list[MountRewrite],
    config_maps: Mapping[str, Mapping[str, str]] | None = None,
    entrypoint: Sequence[str] | None = None,
) -> ProcessSpec:
    """Container command+args, expanded against its env, mount paths made local.

    Kubernetes semantics: ``command`` replaces the image ENTRYPOINT and ``args`` its CMD;
    without ``command`` the argv is ``entrypoint + args`` (the table knows no CMD; the
    entrypoint itself is not ``$(VAR)``-expanded). Without either, ``argv`` is empty.
    """
    env = container_env(pod, container, implicit, config_maps)
    env = {key: rewrite_paths(value, rewrites) for key, value in env.items()}

    def arg(text: object) -> str:
        # The literal is rewritten, then expanded with the (already rewritten) env: a
        # path is rewritten once, never again inside a value that was.
        return expand(rewrite_paths(str(text), rewrites), env)

    command = container.get("command") or []
    if command:
        argv = [arg(a) for a in command]
    elif entrypoint is not None:
        argv = [rewrite_paths(a, rewrites) for a in entrypoint]
    else:
        argv = []
    if argv:
        argv += [arg(a) for a in (container.get("args") or [])]
    working_dir = container.get("workingDir")
    cwd = rewrite_paths(working_dir, rewrites) if working_dir else None
    return ProcessSpec(argv=argv, env=env, cwd=cwd, rewrites=rewrites)


def downward_api_files(pod: JsonDict, volume: JsonDict) -> dict[str, str]:
    """Relative path -> content for a ``downwardAPI`` volume."""
    files: dict[str, str] = {}
    for item in (volume.get("downwardAPI") or {}).get("items") or []:
        ref = item.get("fieldRef")
        if ref:
            value = field_value(pod, ref.get("fieldPath", ""))
            if value is not None:
                files[item["path"]] = value
    return files


def config_map_files(volume: JsonDict, data: Mapping[str, V]) -> dict[str, V]:
    """Relative path -> content for a ``configMap`` volume (honours ``items``)."""
    return key_files((volume.get("configMap") or {}).get("items"), data)


def secret_files(volume: JsonDict, data: Mapping[str, V]) -> dict[str, V]:
    """Relative path -> content for a ``secret`` volume (honours ``items``)."""
    return key_files((volume.get("secret") or {}).get("items"), data)


def key_files(items: list[JsonDict] | None, data: Mapping[str, V]) -> dict[str, V]:
    if not items:
        return dict(data)
    return {item["path"]: data[item["key"]] for item in items if item["key"] in data}


def config_map_data(obj: JsonDict) -> dict[str, bytes]:
    """A ConfigMap's ``data`` (UTF-8) and ``binaryData`` (base64) as file contents."""
    data = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def secret_data(obj: JsonDict) -> dict[str, bytes]:
    """A Secret's ``data`` (base64) as file contents."""
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


def is_runnable(pod: JsonDict, image_substrings: tuple[str, ...], runnable_label: str) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(runnable_label) == "true":
        return True
    containers = (pod.get("spec") or {}).get("containers") or []
    return any(sub in str(c.get("image", "")) for c in containers for sub in image_substrings)


CONFIGMAPS = "configmaps"
SECRETS = "secrets"
TOKEN_SOURCE = "serviceAccountToken"


def projected_refs(volume: JsonDict) -> list[tuple[str, str]]:
    """(resource, name) of each configMap and secret source of a ``projected`` volume."""
    refs = []
    for source in (volume.get("projected") or {}).get("sources") or []:
        if source.get("configMap"):
            refs.append((CONFIGMAPS, str(source["configMap"].get("name", ""))))
        if source.get("secret"):
            refs.append((SECRETS, str(source["secret"].get("name", ""))))
    return refs


def projected_files(
    pod: JsonDict,
    volume: JsonDict,
    objects: Mapping[tuple[str, str], JsonDict],
    tokens: Mapping[int, str],
) -> dict[str, bytes]:
    """Relative path -> content for a ``projected`` volume.

    ``objects`` holds the ConfigMaps/Secrets by (resource, name) (``{}`` or absent when
    they do not exist), ``tokens`` the token of each ``serviceAccountToken`` source by its
    index in ``sources``. ``clusterTrustBundle`` and ``podCertificate`` sources are not
    supported (nothing is written for them).
    """
    files: dict[str, bytes] = {}
    for index, source in enumerate((volume.get("projected") or {}).get("sources") or []):
        if source.get("configMap"):
            ref = source["configMap"]
            obj = objects.get((CONFIGMAPS, str(ref.get("name", "")))) or {}
            files.update(key_files(ref.get("items"), config_map_data(obj)))
        elif source.get("secret"):
            ref = source["secret"]
            obj = objects.get((SECRETS, str(ref.get("name", "")))) or {}
            files.update(key_files(ref.get("items"), secret_data(obj)))
        elif source.get("downwardAPI"):
            downward = downward_api_files(pod, source)
            files.update({k: v.encode() for k, v in downward.items()})
        elif source.get(TOKEN_SOURCE) and index in tokens:
            files[str(source[TOKEN_SOURCE].get("path", "token"))] = tokens[index].encode()
    return files
