"""What to do with the engine pods now (pure): create, drain, delete; the rollout's step.

Rules:

- **Scale.** Missing pods of the current revision are created at once (lowest free
  ordinals). Extra pods leave cache-aware: first those that serve nothing (not ready,
  not registered), then the one whose loss costs the least cached work — the fewest
  blocks only it holds in the gateway's index (``unique_blocks``), then the fewest blocks
  at all, then the highest ordinal.
- **Rollout** (a new revision; after LWS DisaggregatedSet's proportional steps, both pools
  in step). With ``O`` old pods when it began and ``T`` wanted, ``batch = maxSurge``
  (at least 1) and ``S = max over pools of ceil(max(O, T) / batch)`` steps, step ``i``
  wants ``ceil(i*T/S)`` new pods and ``O - floor(i*O/S)`` old ones. New pods are added
  first (surge); old ones are retired only when every new pod of *both* pools is
  registered in the gateway (healthy and subscribed to its KV events, not merely Ready),
  and the step advances only when the retired pods are gone.
- **Retire** = drain, then delete. A pod that is not Ready is deleted at once. Else the
  operator annotates it ``mooncake.io/drain=true``; the gateway stops sending it new
  requests (for good: a drained pod is never routed to again); the pod is deleted once
  the gateway reports it unroutable with nothing in flight (requests count from their
  decision on), or after the drain timeout.
- A pod that finished (Succeeded/Failed) is deleted and replaced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mooncake_contract import conventions as c

from .observe import PodView, Registry

ROLES = (c.ROLE_PREFILL, c.ROLE_DECODE)


@dataclass(frozen=True, slots=True)
class RolloutState:
    """A rollout in progress, kept in ``status.rollout`` between reconciles."""

    revision: str
    step: int
    steps: int
    from_counts: dict[str, int]
    started_at: float


@dataclass(frozen=True, slots=True)
class PoolInput:
    """Everything the plan reads."""

    revision: str
    desired: dict[str, int]
    max_surge: int | str
    drain_timeout_s: float
    pods: list[PodView]
    registry: Registry | None  # None: the gateway could not be read
    gateway_gate: bool  # new pods must be registered in the gateway (gateway enabled)
    start_allowed: bool  # dependencies up (the store), so engine pods may be created
    rollout: RolloutState | None
    now: float


@dataclass(slots=True)
class PoolPlan:
    create: list[tuple[str, int]] = field(default_factory=list)  # (role, ordinal)
    drain: list[PodView] = field(default_factory=list)
    delete: list[PodView] = field(default_factory=list)
    rollout: RolloutState | None = None
    #: why it waits, e.g. "2 new prefill pods not registered"
    waiting: list[str] = field(default_factory=list)
    #: what kind of progress is under way: Creating, ScalingUp, ScalingDown, RollingUpdate...
    activity: str | None = None

    @property
    def writes(self) -> bool:
        return bool(self.create or self.drain or self.delete)


def surge_count(max_surge: int | str, pool_size: int) -> int:
    """``maxSurge`` as a pod count: an int, or a percentage of the pool rounded up; at
    least 1."""
    if isinstance(max_surge, int):
        return max(1, max_surge)
    pct = int(max_surge.rstrip("%"))
    return max(1, math.ceil(pool_size * pct / 100))


def free_ordinals(taken: set[int], count: int) -> list[int]:
    out: list[int] = []
    i = 0
    while len(out) < count:
        if i not in taken:
            out.append(i)
        i += 1
    return out


def serves(p: PodView) -> bool:
    """The pod may take traffic: it is Ready, so the gateway may route to it at any moment
    (a registry snapshot saying otherwise can be stale by the time a pod is deleted), and
    it leaves by draining. A pod that is not Ready takes no traffic and leaves at once."""
    return p.ready


def usable(p: PodView, registry: Registry | None, gateway_gate: bool) -> bool:
    """A new pod counts toward a rollout step: Ready, and registered in the gateway."""
    if not p.ready:
        return False
    if not gateway_gate:
        return True
    g = registry.get(p.name) if registry is not None else None
    return g is not None and g.registered


def victim_order(pods: list[PodView], registry: Registry | None, gateway_gate: bool
                 ) -> list[PodView]:
    """Pods in the order they should leave (cache-aware)."""

    def key(p: PodView) -> tuple[int, int, int, int, int]:
        g = registry.get(p.name) if registry is not None else None
        unique = g.unique_blocks if g else 0
        blocks = g.index_blocks if g else 0
        registered = g is not None and g.registered
        return (1 if serves(p) else 0, 1 if registered else 0, unique, blocks, -p.ordinal)

    return sorted(pods, key=key)


def drained(p: PodView, inp: PoolInput) -> bool:
    """A draining pod may now be deleted."""
    if not p.ready:
        return True
    if p.drain_since is not None and inp.now - p.drain_since >= inp.drain_timeout_s:
        return True
    if not inp.gateway_gate:
        return True
    if inp.registry is None:
        return False
    g = inp.registry.get(p.name)
    return g is None or (not g.routable and g.inflight == 0)


def _retire(pods: list[PodView], count: int, inp: PoolInput, plan: PoolPlan) -> None:
    for p in victim_order(pods, inp.registry, inp.gateway_gate)[:max(0, count)]:
        if serves(p):
            plan.drain.append(p)
        else:
            plan.delete.append(p)


def plan(inp: PoolInput) -> PoolPlan:
    out = PoolPlan(rollout=inp.rollout)
    live: dict[str, list[PodView]] = {r: [] for r in ROLES}
    taken: dict[str, set[int]] = {r: set() for r in ROLES}
    draining = 0
    for p in inp.pods:
        if p.revision == inp.revision:
            taken[p.role].add(p.ordinal)
        if p.terminating:
            continue
        if p.finished:
            out.delete.append(p)
            continue
        if p.draining:
            draining += 1
            if drained(p, inp):
                out.delete.append(p)
            continue
        live[p.role].append(p)
    new = {r: [p for p in live[r] if p.revision == inp.revision] for r in ROLES}
    old = {r: [p for p in live[r] if p.revision != inp.revision] for r in ROLES}

    def create(role: str, count: int) -> None:
        if count <= 0:
            return
        if not inp.start_allowed:
            out.waiting.append("waiting for the Mooncake Store before starting engines")
            return
        for i in free_ordinals(taken[role], count):
            taken[role].add(i)
            out.create.append((role, i))

    if not any(old[r] for r in ROLES):
        out.rollout = None
        for role in ROLES:
            want, have = inp.desired[role], len(new[role])
            if have < want:
                create(role, want - have)
                out.activity = out.activity or ("Creating" if have == 0 else "ScalingUp")
            elif have > want:
                _retire(new[role], have - want, inp, out)
                out.activity = out.activity or "ScalingDown"
        if draining and out.activity is None:
            out.activity = "Draining"
        return out

    # -- a rollout ------------------------------------------------------------------------------
    state = inp.rollout
    if state is None or state.revision != inp.revision:
        state = RolloutState(revision=inp.revision, step=1, steps=1,
                             from_counts={r: len(old[r]) for r in ROLES}, started_at=inp.now)
    steps = 1
    for role in ROLES:
        o0, t = state.from_counts.get(role, 0), inp.desired[role]
        if o0 or t:
            steps = max(steps, math.ceil(max(o0, t) / surge_count(inp.max_surge, max(o0, t))))
    step = min(max(1, state.step), steps)
    want_new: dict[str, int] = {}
    want_old: dict[str, int] = {}
    for role in ROLES:
        o0, t = state.from_counts.get(role, 0), inp.desired[role]
        want_new[role] = min(t, math.ceil(step * t / steps))
        want_old[role] = max(0, o0 - (step * o0) // steps)
    out.activity = "RollingUpdate"
    for role in ROLES:
        create(role, want_new[role] - len(new[role]))
        if len(new[role]) > inp.desired[role]:
            _retire(new[role], len(new[role]) - inp.desired[role], inp, out)
    gate_ok = True
    for role in ROLES:
        ready = [p for p in new[role] if usable(p, inp.registry, inp.gateway_gate)]
        if len(new[role]) < want_new[role] or len(ready) < min(len(new[role]), want_new[role]):
            gate_ok = False
            missing = want_new[role] - len(ready)
            what = "registered in the gateway" if inp.gateway_gate else "ready"
            out.waiting.append(f"{missing} new {role} pod(s) not yet {what}")
    if gate_ok:
        for role in ROLES:
            _retire(old[role], len(old[role]) - want_old[role], inp, out)
        settled = draining == 0 and not out.drain and not any(
            p.revision != inp.revision for p in out.delete if not p.finished)
        if settled and all(len(old[r]) <= want_old[r] for r in ROLES) and step < steps:
            step += 1
    out.rollout = RolloutState(revision=state.revision, step=step, steps=steps,
                               from_counts=dict(state.from_counts),
                               started_at=state.started_at)
    return out
