"""Work stealing: an instance that goes idle takes a prefill queued elsewhere.

Rule: when a prefill instance finishes and its own queue is empty, every prompt
still queued on another instance (not a chunked-pipeline group's) is priced two
ways: where it is, ``T_old`` = the predicted remaining run of that instance plus
the queued work ahead of it plus its own; and here, now, ``T_new`` = the idle
instance's own prefix or a fetch of the longest stored prefix any holder has
(``max(transfer, 0) + prefill``, as placement prices it). The prompt with the
largest saving ``T_old - T_new + behind * work`` (the prompts behind it start
``work`` earlier too) moves here when its own saving is at least ``min_gain_s``
and ``min_gain_share`` of ``T_old``, and its prefill here takes at most
``max_extra_share`` longer than its work there: a move fills idle time, it does
not trade a reused prefix for a recomputed one (that GPU time is lost to the
prompts that arrive next).

Why: placement binds a prompt to a queue on predictions. Executions differ from
them (per-request noise, a wrong model), so some queues drain early while others
run late; the binding was right when made and is stale when a node idles. The
paper's Conductor binds once (§4); late binding of queued work is the classic
remedy (work stealing, Blumofe & Leiserson 1999; SGLang's and llm-d's gateways
also bind at arrival). A prompt whose prefix a later prompt on its queue is set
to reuse (the later prompt was placed to read what this one writes) stays.

A gateway can steal only what it still holds: queues it keeps itself. Ours does
so when asked (late binding, ``prefill_dispatch_depth`` 1: one prefill per engine
at a time, the rest held); the simulator models the same (docs/conductor.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from .cost import CostModel
from .policies.base import Placement
from .state import ClusterState, PrefillState, RequestInfo
from .topology import FetchSources, Topology


class StealingConfig(BaseModel):
    """Work stealing (see :mod:`mooncake_conductor.stealing`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = Field(
        None, description="steal queued prefills for idle instances (None: the policy's "
        "default, on for conductor)")
    min_gain_s: float = Field(
        0.02, ge=0, description="the stolen prompt's predicted TTFT must drop by at least "
        "this many seconds")
    min_gain_share: float = Field(
        0.05, ge=0, le=1, description="... and by at least this share of its TTFT where it "
        "waits (prediction noise must not move prompts back and forth)")
    max_extra_share: float = Field(
        0.05, ge=0, description="the moved prompt's prefill may take at most this share "
        "longer than its work where it waits (a prefix recomputed instead of reused is GPU "
        "time the next prompts lose)")


@dataclass(frozen=True, slots=True)
class Steal:
    """Move request ``rid`` from ``victim``'s queue to ``placement`` (on the idle
    instance); ``gain_s`` is the predicted TTFT saving of the moved prompt alone."""

    rid: int
    victim: int
    placement: Placement
    gain_s: float


class WorkStealing:
    def __init__(self, config: StealingConfig, cost: CostModel,
                 topology: Topology | None = None) -> None:
        self.config = config
        self.cost = cost
        #: with an active topology, a moved prompt's fetch comes from the nearest holder
        self.topology = topology

    def pick(
        self, idle: PrefillState, cluster: ClusterState,
        request_of: Callable[[int], RequestInfo], now: float,
        movable: Callable[[int], bool],
    ) -> Steal | None:
        """The best prompt for ``idle`` to take now, or ``None``. ``request_of`` maps a
        queued request id to its request; ``movable(rid)`` says whether the caller can
        move it (e.g. not a pipeline group's)."""
        cfg = self.config
        cost, topo = self.cost, self.topology
        best: Steal | None = None
        best_score = 0.0
        index = cluster.index
        search = cluster.prefill_mask
        if cluster.store_id is not None:
            search |= 1 << cluster.store_id
        for victim in cluster.prefill:
            if victim is idle or not victim.up or not victim.queue:
                continue
            ahead = max(0.0, victim.busy_until - now)
            order = sorted(victim.queue)
            for pos, item in enumerate(order):
                old_ttft = ahead + item.work_s
                ahead = old_ttft
                if old_ttft < cfg.min_gain_s or not movable(item.rid):
                    continue
                req = request_of(item.rid)
                stored, _, src, src_len = index.match_lengths(
                    req.keys, search, None, key_array=req.key_array)
                own = int(stored[victim.iid])  # the arrays cover every id searched
                if any(_common_blocks(req.keys, request_of(q.rid).keys) > own
                       for q in order[pos + 1:]):
                    continue  # a later prompt here reads what this one writes
                local = int(stored[idle.iid])
                n = req.input_tokens
                local_tokens = req.tokens_of(local)
                prefill = cost.prefill_time(n, local_tokens)
                pl = Placement(prefill=idle.iid, local_blocks=local, prefill_s=prefill,
                               priority=item.priority)
                if src is not None and src_len > local and src != idle.iid:
                    fetch_prefill = cost.prefill_time(n, req.tokens_of(src_len))
                    tokens = req.tokens_of(src_len) - local_tokens
                    holders = (FetchSources.of(topo, cluster, stored, src_len)
                               if topo is not None and topo.active else None)
                    if holders is None:
                        transfer = cost.transfer_time(tokens)
                    else:
                        transfer = holders.time_to(cost, tokens, idle.place)
                        src = holders.source_for(cost, tokens, idle.place)
                    if transfer + fetch_prefill < prefill:
                        pl = Placement(prefill=idle.iid, local_blocks=local,
                                       fetch_blocks=src_len - local, source=src,
                                       transfer_s=transfer, prefill_s=fetch_prefill,
                                       priority=item.priority, migrate=True)
                if pl.prefill_s > item.work_s * (1.0 + cfg.max_extra_share):
                    continue  # it would recompute what it reuses where it waits
                gain = old_ttft - pl.ttft_s
                if gain < cfg.min_gain_s or gain < cfg.min_gain_share * old_ttft:
                    continue
                score = gain + (len(order) - pos - 1) * item.work_s
                if score > best_score:
                    best, best_score = Steal(item.rid, victim.iid, pl, gain), score
        return best


def _common_blocks(a: list[int], b: list[int]) -> int:
    """Leading blocks two prompts share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
