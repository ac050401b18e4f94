"""The MooncakeCluster status from what was observed and planned (pure).

Conditions (``metav1.Condition``), with reasons that tell the causes apart:

- ``Ready`` — True when every desired pod of the current revision is Ready and registered
  in the gateway, no pod of an older revision is left and the store is ready. Else False
  with the first that applies of: ``InvalidSpec`` (or ``ServedNameConflict``: another
  cluster's model has this name in the gateway), ``InsufficientGPUCapacity``,
  ``NoMatchingNodes``, ``Unschedulable``, ``EngineCrashLooping``, ``StoreNotReady``
  (``StoreDegraded`` when the store cannot come up), ``RolloutInProgress``,
  ``GatewayUnreachable``, ``Scaling``, ``EngineNotReady``.
- ``Progressing`` — True while pods are created, rolled, scaled or drained (reason
  ``Creating``, ``ScalingUp``, ``ScalingDown``, ``RollingUpdate``, ``Draining``,
  ``WaitingForStore``); False ``Complete`` at rest, ``Stalled`` when Degraded blocks it.
- ``Degraded`` — True when something will not fix itself: a spec the operator cannot
  honour, pods the scheduler cannot place (no node with enough GPUs, a node selector
  matching nothing), engines or the store crash-looping, or the API server refusing a call
  the operator needs (``Forbidden``: its service account lacks a permission; written by
  :meth:`~.reconcile.Reconciler.report` when a reconcile stops on a 403). False
  ``AsExpected``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_contract import conventions as c

from . import rollout as ro
from .observe import PodView, Registry, StoreView, rfc3339
from .spec import (
    Condition,
    ConditionStatus,
    GatewayStatus,
    HotPrefixStatus,
    MooncakeClusterStatus,
    PoolStatus,
    RolloutStatus,
    StoreStatus,
)

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED)


@dataclass(frozen=True, slots=True)
class Problem:
    """Why the cluster is Degraded."""

    reason: str
    message: str


def forbidden_problem(message: str, request: str = "") -> Problem:
    """A call the API server refused (403): RBAC lacks a permission the operator needs."""
    call = f" ({request})" if request else ""
    return Problem("Forbidden", f"the API server refused a call{call}: {message}; grant the "
                   "operator's service account what operator/mooncake_operator/permissions.py "
                   "lists (the chart's Role)")


def scheduling_problem(pods: list[PodView], gpu_resource: str) -> Problem | None:
    """The scheduler's verdict on pods it could not place, as a reason."""
    for p in pods:
        msg = p.unschedulable
        if msg is None or p.terminating:
            continue
        if f"Insufficient {gpu_resource}" in msg:
            return Problem("InsufficientGPUCapacity",
                           f"no node has the GPUs {p.name} requests: {msg}")
        if "node affinity/selector" in msg or "untolerated taint" in msg:
            return Problem("NoMatchingNodes",
                           f"no node matches {p.name}'s node selector/affinity: {msg}")
        return Problem("Unschedulable", f"{p.name} cannot be scheduled: {msg}")
    return None


def crash_problem(pods: list[PodView], recent: dict[str, int], threshold: int,
                  window_s: float) -> Problem | None:
    """The first pod with ``threshold`` crashes or more in the window (``crashes.py``)."""
    for p in pods:
        n = recent.get(p.uid, 0)
        if not p.terminating and n >= threshold:
            return Problem("EngineCrashLooping",
                           f"{p.name} crashed {n} times in the last {window_s / 60:g} min "
                           f"({p.restarts} restarts in all); see its logs")
    return None


def store_problem(store: StoreView) -> Problem | None:
    if not store.enabled:
        return None
    if store.master_problem:
        return Problem("StoreDegraded", f"store master: {store.master_problem}")
    if store.nodes_problem:
        return Problem("StoreDegraded", f"store node: {store.nodes_problem}")
    return None


def pool_status(role: str, desired: int, pods: list[PodView], revision: str,
                registry: Registry | None, gateway_gate: bool) -> PoolStatus:
    mine = [p for p in pods if p.role == role and not p.terminating and not p.finished]
    updated = [p for p in mine if p.revision == revision and not p.draining]
    ready = [p for p in updated if p.ready]
    registered = [p for p in ready if ro.usable(p, registry, gateway_gate)]
    return PoolStatus(desired=desired, current=len(mine), ready=len(ready),
                      updated=len(updated), registered=len(registered),
                      summary=f"{len(registered) if gateway_gate else len(ready)}/{desired}")


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int,
               previous: dict[str, Condition], now: float) -> Condition:
    status = ConditionStatus.TRUE if ok else ConditionStatus.FALSE
    prev = previous.get(ctype)
    since = prev.last_transition_time if prev is not None and prev.status == status else None
    return Condition(type=ctype, status=status, reason=reason, message=message,
                     last_transition_time=since or rfc3339(now),
                     observed_generation=generation)


@dataclass(frozen=True, slots=True)
class StatusInput:
    generation: int
    revision: str
    policy: str
    desired: dict[str, int]
    pods: list[PodView]
    registry: Registry | None
    gateway_gate: bool
    gateway_endpoint: str
    served_model: str
    store: StoreView
    store_address: str
    plan: ro.PoolPlan
    invalid: Problem | None  # a spec the operator cannot honour (or a served-name conflict)
    hot_prefixes: list[HotPrefixStatus]
    previous: MooncakeClusterStatus
    gpu_resource: str
    crash_restarts: int  # crashes in the window that make a pod crash-looping
    crash_window_s: float
    #: each pod's crashes in the last crash_window_s, by uid (crashes.CrashHistory)
    recent_crashes: dict[str, int]
    now: float


def compute(inp: StatusInput) -> MooncakeClusterStatus:
    pools = {role: pool_status(role, inp.desired.get(role, 0), inp.pods, inp.revision,
                               inp.registry, inp.gateway_gate) for role in ro.ROLES}
    old_left = any(p.revision != inp.revision and not p.terminating and not p.finished
                   for p in inp.pods)
    degraded = (inp.invalid or scheduling_problem(inp.pods, inp.gpu_resource)
                or crash_problem(inp.pods, inp.recent_crashes, inp.crash_restarts,
                                 inp.crash_window_s)
                or store_problem(inp.store))
    at_target = all(pools[r].registered == pools[r].desired == pools[r].current
                    if inp.gateway_gate else pools[r].ready == pools[r].desired == pools[r].current
                    for r in ro.ROLES)
    ready = at_target and not old_left and inp.store.ready and inp.invalid is None
    if ready:
        ready_reason, ready_msg = "AllReady", (
            f"{pools['prefill'].desired} prefill and {pools['decode'].desired} decode pods "
            f"of revision {inp.revision} serving")
    elif degraded is not None:
        ready_reason, ready_msg = degraded.reason, degraded.message
    elif not inp.store.ready:
        ready_reason, ready_msg = "StoreNotReady", (
            f"store master ready: {inp.store.master_ready}, store nodes "
            f"{inp.store.nodes_ready}/{inp.store.nodes_desired}")
    elif old_left or inp.plan.rollout is not None:
        r = inp.plan.rollout
        step = f" (step {r.step}/{r.steps})" if r is not None else ""
        ready_reason, ready_msg = "RolloutInProgress", (
            f"replacing pods with revision {inp.revision}{step}; "
            + "; ".join(inp.plan.waiting or ["retiring old pods"]))
    elif inp.gateway_gate and inp.registry is None:
        ready_reason, ready_msg = "GatewayUnreachable", (
            f"cannot read the gateway's registry at {inp.gateway_endpoint}, or it does not "
            f"serve model {inp.served_model!r} yet")
    elif any(pools[r].current > pools[r].desired for r in ro.ROLES):
        ready_reason, ready_msg = "Scaling", "retiring pods beyond the desired count"
    else:
        ready_reason = "EngineNotReady"
        ready_msg = "; ".join(
            f"{r}: {pools[r].ready} ready, {pools[r].registered} registered of "
            f"{pools[r].desired}" for r in ro.ROLES)
    activity = inp.plan.activity
    if activity is None and inp.plan.waiting:
        activity = "WaitingForStore" if not inp.store.ready else "WaitingForGateway"
    if activity is None and not ready and degraded is None and not at_target:
        activity = "WaitingForEngines"
    progressing = activity is not None and degraded is None
    if progressing:
        prog_reason, prog_msg = str(activity), "; ".join(inp.plan.waiting) or str(activity)
    elif degraded is not None and not ready:
        prog_reason, prog_msg = "Stalled", degraded.message
    else:
        prog_reason, prog_msg = "Complete", "pools match the spec"
    prev = {cond.type: cond for cond in inp.previous.conditions}
    g = inp.generation
    conditions = [
        _condition(READY, ready, ready_reason, ready_msg, g, prev, inp.now),
        _condition(PROGRESSING, progressing, prog_reason, prog_msg, g, prev, inp.now),
        _condition(DEGRADED, degraded is not None,
                   degraded.reason if degraded else "AsExpected",
                   degraded.message if degraded else "", g, prev, inp.now),
    ]
    store = StoreStatus(
        state=("Disabled" if not inp.store.enabled else "Ready" if inp.store.ready
               else "Degraded" if store_problem(inp.store) else "Pending"),
        master_ready=inp.store.master_ready, nodes_desired=inp.store.nodes_desired,
        nodes_ready=inp.store.nodes_ready,
        address=inp.store_address if inp.store.enabled else "")
    r = inp.plan.rollout
    rollout = None if r is None else RolloutStatus(
        revision=r.revision, step=r.step, steps=r.steps,
        from_prefill=r.from_counts.get(c.ROLE_PREFILL, 0),
        from_decode=r.from_counts.get(c.ROLE_DECODE, 0), started_at=rfc3339(r.started_at))
    return MooncakeClusterStatus(
        observed_generation=g, revision=inp.revision, conditions=conditions,
        prefill=pools[c.ROLE_PREFILL], decode=pools[c.ROLE_DECODE], store=store,
        gateway=GatewayStatus(endpoint=inp.gateway_endpoint if inp.gateway_gate else "",
                              model=inp.served_model, reachable=inp.registry is not None),
        rollout=rollout, hot_prefixes=inp.hot_prefixes, policy=inp.policy)


def rollout_state(status: MooncakeClusterStatus) -> ro.RolloutState | None:
    r = status.rollout
    if r is None:
        return None
    from .observe import parse_time

    return ro.RolloutState(
        revision=r.revision, step=r.step, steps=r.steps,
        from_counts={c.ROLE_PREFILL: r.from_prefill, c.ROLE_DECODE: r.from_decode},
        started_at=parse_time(r.started_at) or 0.0)


def transitions(before: MooncakeClusterStatus, after: MooncakeClusterStatus
                ) -> list[Condition]:
    """Conditions whose status or reason changed (each becomes a Kubernetes Event)."""
    prev = {cond.type: cond for cond in before.conditions}
    out = []
    for cond in after.conditions:
        p = prev.get(cond.type)
        if p is None or p.status != cond.status or p.reason != cond.reason:
            out.append(cond)
    return out
