"""Fault drills on the embedded cluster (``benchmarks/chaos.py``,
``tests/operator/test_chaos_cluster.py``): find a pod's processes and signal them, read a
gateway's view of one engine, judge a replay's outcomes around the moment of a fault, and
list what a fault left broken.

Pods of our image are local processes of the pod runner; it records each container's
process (the group leader: the container's command after the mount helper's ``exec``)
in ``<state>/pod-pids/<pod uid>-<container>.pid.json``.

Definitions used by the report (all times in wall seconds from the fault's injection):

- *recovery*: until the end of the last failed request that ended after the injection
  (0 when none failed). A request rejected with 429 is not a failure: admission said no,
  and the client was told at once.
- *in flight*: a request sent before the injection that had not ended at it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import statistics
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mooncake_localcluster import procs
from mooncake_localcluster.kubehttp import ApiError, KubeHttp

JsonDict = dict[str, Any]
GROUP_PATH = "/apis/mooncake.io/v1alpha1"
STATUSES = ("ok", "rejected", "failed")


# -- processes --------------------------------------------------------------------------------
def container_pids(state_dir: Path, pod: JsonDict, container: str | None = None) -> list[int]:
    """Live processes the pod runner started for ``pod`` (one container, or all)."""
    uid = pod["metadata"]["uid"]
    prefix = f"{uid}-{container}" if container else f"{uid}-"
    return [r.pid for r in procs.records(state_dir / "pod-pids")
            if (r.name == prefix if container else r.name.startswith(prefix))
            and procs.alive(r)]


def signal_container(state_dir: Path, pod: JsonDict, container: str, sig: int,
                     group: bool = False) -> list[int]:
    """Send ``sig`` to a container's process (``group``: its whole process group);
    returns the pids signalled. Raises when the container has no live process."""
    pids = container_pids(state_dir, pod, container)
    if not pids:
        raise RuntimeError(f"no live process of {pod['metadata']['name']}/{container}")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
    return pids


def orphan_pod_processes(state_dir: Path, live_uids: set[str]) -> list[str]:
    """Pod-runner processes still running for pods that no longer exist."""
    out = []
    for r in procs.records(state_dir / "pod-pids"):
        uid = r.name[:36]
        if uid not in live_uids and procs.alive(r):
            out.append(f"process {r.pid} of gone pod {r.name}")
    return out


# -- pods and clusters ------------------------------------------------------------------------
def pod_ready(pod: JsonDict) -> bool:
    st = pod.get("status") or {}
    return st.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in st.get("conditions") or [])


def pods(http: KubeHttp, ns: str, selector: str = "") -> list[JsonDict]:
    q = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
    items: list[JsonDict] = http.get(f"/api/v1/namespaces/{ns}/pods{q}")["items"]
    return items


def engine_pods(http: KubeHttp, ns: str, cluster: str, role: str) -> list[JsonDict]:
    """The cluster's live (not terminating) pods of ``role``, by name."""
    items = pods(http, ns, f"mooncake.io/cluster={cluster},mooncake.io/role={role}")
    return sorted((p for p in items if not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: str(p["metadata"]["name"]))


def restarts(items: Iterable[JsonDict]) -> dict[str, int]:
    """Container restarts per ``pod/container``."""
    out = {}
    for p in items:
        for c in (p.get("status") or {}).get("containerStatuses") or []:
            out[f"{p['metadata']['name']}/{c['name']}"] = int(c.get("restartCount", 0))
    return out


def cluster_ready(http: KubeHttp, ns: str, name: str) -> tuple[bool, str]:
    """(Ready for the current generation, the Ready reason)."""
    obj = http.get(f"{GROUP_PATH}/namespaces/{ns}/mooncakeclusters/{name}")
    st = obj.get("status") or {}
    current = st.get("observedGeneration") == obj["metadata"].get("generation")
    for c in st.get("conditions") or []:
        if c.get("type") == "Ready":
            return current and c.get("status") == "True", str(c.get("reason", ""))
    return False, "NoStatus"


# -- a gateway's view -------------------------------------------------------------------------
def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def gateway_instances(gateway_url: str, model: str) -> dict[str, JsonDict]:
    """Every instance ``/conductor/state`` lists for ``model``, by ``ns/pod``."""
    data = http_json(f"{gateway_url}/conductor/state?model={urllib.parse.quote(model)}")
    out: dict[str, JsonDict] = {}
    for m in data.get("models") or []:
        for role in ("prefill", "decode"):
            for i in m.get(role) or []:
                out[str(i.get("pod") or i["name"])] = i
    return out


def routable(gateway_url: str, model: str) -> set[str]:
    return {k for k, v in gateway_instances(gateway_url, model).items() if v.get("routable")}


#: the key prefix of :func:`rejections`' time-to-429 buckets
REJECTION_SECONDS = "seconds/"


def _label(labels: str, name: str) -> str:
    return labels.split(f'{name}="', 1)[1].split('"', 1)[0]


def rejections(gateway_url: str) -> dict[str, float]:
    """The gateway's 429s so far, by reason (``mooncake_gateway_rejections_total``), and
    the cumulative buckets of its own time to each (``mooncake_gateway_rejection_seconds``)
    as ``seconds/<path>/<le>``."""
    with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("mooncake_gateway_rejections_total{"):
            labels, _, value = line.rpartition(" ")
            reason = _label(labels, "reason")
            out[reason] = out.get(reason, 0.0) + float(value)
        elif line.startswith("mooncake_gateway_rejection_seconds_bucket{"):
            labels, _, value = line.rpartition(" ")
            key = f"{REJECTION_SECONDS}{_label(labels, 'path')}/{_label(labels, 'le')}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def split_rejections(grew: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """What :func:`rejections` counted, split: the 429s by reason, and the cumulative
    buckets of the gateway's time to each by ``<path>/<le>``."""
    by_reason = {k: v for k, v in grew.items() if not k.startswith(REJECTION_SECONDS)}
    times = {k.removeprefix(REJECTION_SECONDS): v for k, v in grew.items()
             if k.startswith(REJECTION_SECONDS)}
    return by_reason, times


def increase(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """What grew between two reads of a counter family (non-zero entries)."""
    out = {k: round(v - before.get(k, 0.0)) for k, v in after.items()}
    return {k: v for k, v in sorted(out.items()) if v}


# -- outcomes around a fault ------------------------------------------------------------------
def counts(outcomes: Iterable[JsonDict]) -> dict[str, int]:
    out = dict.fromkeys(STATUSES, 0)
    for o in outcomes:
        out[o["status"]] = out.get(o["status"], 0) + 1
    return out


def phases(outcomes: list[JsonDict], inject_s: float) -> dict[str, dict[str, int]]:
    """Outcomes of the requests sent before the injection and ended before it, of those in
    flight at it, and of those sent after it."""
    before = [o for o in outcomes if o["done_s"] < inject_s]
    flight = [o for o in outcomes if o["sent_s"] < inject_s <= o["done_s"]]
    after = [o for o in outcomes if o["sent_s"] >= inject_s]
    return {"before": counts(before), "in_flight": counts(flight), "after": counts(after)}


def per_second(outcomes: list[JsonDict], inject_s: float, bin_s: float = 1.0
               ) -> list[dict[str, float]]:
    """Outcomes by send time in ``bin_s`` bins, ``t`` relative to the injection."""
    if not outcomes:
        return []
    first = math.floor((min(o["sent_s"] for o in outcomes) - inject_s) / bin_s)
    last = math.floor((max(o["sent_s"] for o in outcomes) - inject_s) / bin_s)
    bins = {b: dict.fromkeys(STATUSES, 0) for b in range(first, last + 1)}
    for o in outcomes:
        b = math.floor((o["sent_s"] - inject_s) / bin_s)
        bins[b][o["status"]] += 1
    return [{"t": b * bin_s, **v} for b, v in sorted(bins.items())]


def recovery_s(outcomes: list[JsonDict], inject_s: float) -> float:
    """Seconds from the injection until the last failed request ended (0 when none
    failed after the injection)."""
    ends = [float(o["done_s"]) - inject_s for o in outcomes
            if o["status"] == "failed" and o["done_s"] >= inject_s]
    return max([0.0, *ends])


def ttft_p50(outcomes: list[JsonDict], lo: float, hi: float) -> float | None:
    """Median TTFT (modelled s) of served requests sent in ``[lo, hi)``."""
    vals = [o["ttft_s"] for o in outcomes
            if o["status"] == "ok" and lo <= o["sent_s"] < hi and o["ttft_s"] == o["ttft_s"]]
    return float(statistics.median(vals)) if vals else None


def ready_summary(samples: list[tuple[float, str]], inject_s: float) -> JsonDict:
    """From the 0.5 s samples of the Ready condition: whether it left Ready after the
    injection, for how long in all, the reasons seen, and when it was Ready again for
    good (seconds after the injection; None when it was not Ready at the last sample)."""
    after = [(t, s) for t, s in samples if t >= inject_s]
    bad = [(t, s) for t, s in after if s != "Ready"]
    if not bad:
        return {"left_ready": False, "not_ready_s": 0.0, "ready_again_s": 0.0, "reasons": []}
    not_ready = 0.0
    for (t, s), (t2, _) in itertools.pairwise(after):
        if s != "Ready":
            not_ready += t2 - t
    last_bad = bad[-1][0]
    again = next((t for t, s in after if t > last_bad and s == "Ready"), None)
    return {"left_ready": True, "not_ready_s": round(not_ready, 1),
            "ready_again_s": None if again is None else round(again - inject_s, 1),
            "reasons": sorted({s for _, s in bad})}


# -- what a fault left broken -----------------------------------------------------------------
def leftovers(http: KubeHttp, ns: str, cluster: str, model: str, gateway_urls: list[str],
              state_dir: Path) -> list[str]:
    """What is still wrong: the MooncakeCluster not Ready, pods in ``ns`` not Running and
    Ready (or more engine pods than wanted), gateway entries for gone pods or live engines
    not routable, pod processes of gone pods. Empty when nothing is."""
    out: list[str] = []
    try:
        ready, reason = cluster_ready(http, ns, cluster)
        obj = http.get(f"{GROUP_PATH}/namespaces/{ns}/mooncakeclusters/{cluster}")
        everything = pods(http, ns)
    except (ApiError, OSError, ValueError) as err:
        return [f"API not answering: {err}"]
    if not ready:
        out.append(f"{cluster} not Ready ({reason})")
    live = [p for p in everything if not p["metadata"].get("deletionTimestamp")]
    for p in everything:
        st = p.get("status") or {}
        if p["metadata"].get("deletionTimestamp"):
            out.append(f"pod {p['metadata']['name']} still terminating")
        elif st.get("phase") != "Succeeded" and not pod_ready(p):
            out.append(f"pod {p['metadata']['name']} {st.get('phase')}, not Ready")
    engines: dict[str, set[str]] = {}
    for role in ("prefill", "decode"):
        mine = {f"{ns}/{p['metadata']['name']}" for p in live
                if (p["metadata"].get("labels") or {}).get("mooncake.io/cluster") == cluster
                and (p["metadata"].get("labels") or {}).get("mooncake.io/role") == role}
        engines[role] = mine
        want = int((obj["spec"].get(role) or {}).get("replicas", 0))
        if len(mine) != want:
            out.append(f"{len(mine)} {role} pods, {want} wanted")
    wanted = engines["prefill"] | engines["decode"]
    for url in gateway_urls:
        try:
            seen = gateway_instances(url, model)
        except (OSError, ValueError) as err:
            out.append(f"gateway {url} not answering: {err}")
            continue
        out += gateway_leftovers(url, seen, wanted)
    out += orphan_pod_processes(state_dir, {str(p["metadata"]["uid"]) for p in everything})
    return out


def gateway_leftovers(url: str, seen: dict[str, JsonDict], wanted: set[str]) -> list[str]:
    """What one gateway's ``/conductor/state`` instances (``seen``, by ``ns/pod``) get wrong
    against the live engine pods ``wanted``: a gone pod it still lists, a live one it does
    not route to. An instance whose pod left (``listed`` false) stays in the state with its
    counters; it is not a leftover."""
    listed = {k for k, v in seen.items() if v.get("listed", True)}
    out = [f"gateway {url} lists gone pod {name}" for name in sorted(listed - wanted)]
    routable_now = {k for k, v in seen.items() if v.get("routable")}
    out += [f"gateway {url}: {name} not routable" for name in sorted(wanted - routable_now)]
    return out

