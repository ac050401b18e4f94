"""Chunked pipeline parallel prefill (CPP), Mooncake §3.2 / seed §6.

A group of ``X`` prefill instances splits the model's layers into ``X``
pipeline stages; the prompt is cut into chunks that flow through the stages
one after another, so one long prompt uses ``X`` nodes at once without the
cross-node traffic of tensor parallelism.

Cost model: chunk ``j`` (tokens ``[s_j, e_j)``, everything before it already
computed) takes ``t_j = prefill_compute(e_j, s_j)`` on one whole node, so
``t_j / X`` per stage, plus the activations it hands to the next stage
(``tokens * d_model * elem_bytes`` over the NIC). Every chunk takes the same
time on every stage (a proportionate flow shop), so the pipeline finishes after
``sum_j st_j + (X - 1) * max_j st_j``. Each member is busy for that makespan;
the KV of the whole prompt ends up on the group's leader. Stage ``k`` first works
``k * st_0`` after stage 0 starts, so a member that comes free up to that late delays
nothing (:func:`staggered_start`, what the simulator executes).

Chunk size (the paper leaves it open): small chunks shorten the pipeline's fill and
drain (the ``(X - 1) * max`` term), large ones pay the per-pass overhead and the low
MFU of small passes less often, so the best size depends on the prompt, its cached
prefix and the group. With ``chunk_tokens: 0`` (the default) the planner prices every
size in ``chunk_choices`` with this same cost model and keeps the shortest makespan
(:func:`plan_cpp_for`); a fixed ``chunk_tokens`` is used as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from .cost import CostModel


class CPPConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    chunk_tokens: int = Field(
        0, ge=0, description="tokens per pipeline chunk; 0: planned per prompt and group, "
        "the size of chunk_choices with the shortest predicted makespan")
    chunk_choices: tuple[Annotated[int, Field(gt=0)], ...] = Field(
        (1024, 2048, 4096, 8192), min_length=1,
        description="chunk sizes the planner chooses among (chunk_tokens 0)")
    max_group: int = Field(4, ge=1, description="largest group of prefill instances")
    min_new_tokens: int = Field(
        2048, ge=0, description="consider CPP only when this many tokens must be computed "
        "(2048: two of the smallest chunk; with one chunk a pipeline gains nothing)"
    )
    reserve_idle_share: float = Field(
        0.0, ge=0, le=1, description="when CPP is optional (no SLO at stake), use only idle "
        "instances and leave this share of the pool idle",
    )
    rescue_idle_only: bool = Field(
        True, description="an SLO rescue also uses idle instances only (else: the least "
        "loaded, waiting for all of them)",
    )
    rescue_staggered: bool = Field(
        True, description="when no group of idle instances meets the TTFT SLO, a rescue "
        "may also take instances still busy that come free before their pipeline stage "
        "first works, so the group still starts at once (rescue_idle_only only)",
    )
    opportunistic_staggered: bool = Field(
        True, description="groups for prompts one instance can serve in time may also take "
        "instances still busy that come free before their pipeline stage first works, so "
        "the group still starts at once")
    trigger_share: float = Field(
        1.0, gt=0, description="use CPP when the best single-instance TTFT exceeds this share "
        "of the TTFT SLO (1.0: only prompts one instance cannot serve in time)",
    )


@dataclass(frozen=True, slots=True)
class CPPPlan:
    group_size: int
    chunks: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...]
    makespan_s: float
    chunk_tokens: int = 0

    @property
    def gpu_seconds(self) -> float:
        """Node-seconds the group is held (every member for the whole makespan)."""
        return self.group_size * self.makespan_s


#: a hand-off link other than the NIC: ``(bytes per second, latency per hand-off)``
#: (:meth:`~mooncake_conductor.topology.Topology.link`); ``None``: the node's NIC
Link = tuple[float, float] | None


def _nic(cost: CostModel, link: Link) -> float:
    """Bytes per second of a stage hand-off: ``link``'s, at most the NIC's."""
    nic = cost.config.hardware.nic_bytes_per_s * cost.config.efficiency.transfer_efficiency
    return nic if link is None else min(nic, link[0])


def plan_cpp(cost: CostModel, n: int, cached: int, group_size: int, chunk_tokens: int,
             link: Link = None) -> CPPPlan:
    """Chunks and pipeline makespan for prefilling ``n`` tokens with ``cached`` reused;
    ``link`` (default: the NIC) carries the activations between stages, its latency
    paid once per chunk and stage."""
    if group_size < 1:
        raise ValueError("group_size must be at least 1")
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be positive")
    cached = min(max(cached, 0), n)
    m = cost.config.model
    nic = _nic(cost, link)
    latency = 0.0 if link is None or group_size == 1 else link[1]
    chunks: list[tuple[int, int]] = []
    stages: list[float] = []
    start = cached
    while start < n:
        end = min(n, start + chunk_tokens)
        compute = cost.prefill_compute_time(end, start) / group_size
        handoff = 0.0 if group_size == 1 else (end - start) * m.d_model * m.elem_bytes / nic
        if latency:
            handoff += latency
        chunks.append((start, end))
        stages.append(compute + handoff)
        start = end
    if not stages:
        stages.append(cost.prefill_compute_time(n, n))
        chunks.append((n, n))
    makespan = sum(stages) + (group_size - 1) * max(stages)
    return CPPPlan(group_size, tuple(chunks), tuple(stages), makespan, chunk_tokens)


def _handoff_per_token(cost: CostModel, group_size: int, link: Link = None) -> float:
    """Seconds per token of activations a stage hands to the next (none in a group of 1)."""
    if group_size == 1:
        return 0.0
    m = cost.config.model
    return m.d_model * m.elem_bytes / _nic(cost, link)


@dataclass(frozen=True, slots=True)
class _Span:
    """What a plan's makespan needs of one prompt, cached prefix and chunk size, whatever
    the group: the new tokens, the compute of every chunk summed (on one node), the
    compute of the last full chunk and of the shorter last one (0 when absent)."""

    chunk_tokens: int
    new: int
    full: int
    rest: int
    compute: float
    last: float
    tail: float

    def makespan(self, group_size: int, per_token: float, latency: float = 0.0) -> float:
        top = 0.0
        if self.full:
            top = self.last / group_size + self.chunk_tokens * per_token
        if self.rest:
            top = max(top, self.tail / group_size + self.rest * per_token)
        if latency and group_size > 1:  # each stage of each chunk waits for it once
            chunks = self.full + (1 if self.rest else 0)
            return (self.compute / group_size + self.new * per_token + chunks * latency
                    + (group_size - 1) * (top + latency))
        return self.compute / group_size + self.new * per_token + (group_size - 1) * top


def _span(cost: CostModel, n: int, cached: int, chunk_tokens: int) -> _Span:
    """:class:`_Span` of ``n`` tokens, ``cached`` reused (``0 <= cached < n``): the full
    chunks' compute in one difference of FLOPs, the stages' maximum at the last full chunk
    (a chunk costs more the more context it follows) or the shorter last one."""
    new = n - cached
    ovh = cost.prefill_overhead_s
    full, rest = divmod(new, chunk_tokens)
    compute = last = tail = 0.0
    if full:
        end = cached + full * chunk_tokens
        rate = cost.prefill_flops_rate(chunk_tokens)
        compute += full * ovh + (cost.flops(end) - cost.flops(cached)) / rate
        last = ovh + (cost.flops(end) - cost.flops(end - chunk_tokens)) / rate
    if rest:
        start = cached + full * chunk_tokens
        tail = ovh + (cost.flops(n) - cost.flops(start)) / cost.prefill_flops_rate(rest)
        compute += tail
    return _Span(chunk_tokens, new, full, rest, compute, last, tail)


def cpp_makespan(cost: CostModel, n: int, cached: int, group_size: int,
                 chunk_tokens: int, link: Link = None) -> float:
    """:func:`plan_cpp`'s makespan without building the chunks (equal up to rounding)."""
    cached = min(max(cached, 0), n)
    if n - cached <= 0 or group_size < 1 or chunk_tokens < 1:
        return plan_cpp(cost, n, cached, group_size, chunk_tokens, link).makespan_s
    return _span(cost, n, cached, chunk_tokens).makespan(
        group_size, _handoff_per_token(cost, group_size, link),
        0.0 if link is None else link[1])


def first_stage_s(cost: CostModel, n: int, cached: int, group_size: int,
                  chunk_tokens: int, link: Link = None) -> float:
    """:func:`plan_cpp`'s ``stage_s[0]`` (the same arithmetic) without building the rest:
    how long stage 0 works on the first chunk, the offset :func:`staggered_start` takes."""
    if group_size < 1 or chunk_tokens < 1:
        return plan_cpp(cost, n, cached, group_size, chunk_tokens, link).stage_s[0]
    cached = min(max(cached, 0), n)
    if cached >= n:
        return cost.prefill_compute_time(n, n)
    end = min(n, cached + chunk_tokens)
    compute = cost.prefill_compute_time(end, cached) / group_size
    if group_size == 1:
        return compute + 0.0
    m = cost.config.model
    handoff = (end - cached) * m.d_model * m.elem_bytes / _nic(cost, link)
    if link is not None and link[1]:
        handoff += link[1]
    return compute + handoff


def staggered_start(ready: list[float], offset_s: float) -> float:
    """When a pipeline whose members are free at ``ready`` can start (stage 0's first
    chunk): the members take stages in the order they are free, and stage ``k`` is first
    needed ``k * offset_s`` after the start."""
    return max(t - k * offset_s for k, t in enumerate(sorted(ready)))


class ChunkPricer:
    """Chunk choice and makespan of every group size for one prompt and cached prefix:
    what depends only on the prompt and the chunk size is computed once, so pricing
    several group sizes costs little more than one."""

    def __init__(self, cost: CostModel, n: int, cached: int, config: CPPConfig) -> None:
        self.cost = cost
        self.n = n
        self.cached = cached
        self.config = config
        self._spans: list[_Span] | None = None

    def _all(self) -> list[_Span]:
        if self._spans is None:
            cached = min(max(self.cached, 0), self.n)
            self._spans = [_span(self.cost, self.n, cached, size)
                           for size in sorted(self.config.chunk_choices)]
        return self._spans

    def choose(self, group_size: int, link: Link = None) -> tuple[int, float]:
        """``(chunk size, makespan)`` of the plan :func:`plan_cpp_for` would build: the
        configured chunk, or the choice with the shortest makespan (the smaller size on a
        tie within 1e-9); ``link`` carries the hand-offs (default: the NIC)."""
        cfg, n, cached = self.config, self.n, self.cached
        if cfg.chunk_tokens:
            return cfg.chunk_tokens, cpp_makespan(self.cost, n, cached, group_size,
                                                  cfg.chunk_tokens, link)
        if n - min(max(cached, 0), n) <= 0 or group_size < 1:  # no spans: the plan's
            spans = [(size, cpp_makespan(self.cost, n, cached, group_size, size, link))
                     for size in sorted(cfg.chunk_choices)]
        else:
            per_token = _handoff_per_token(self.cost, group_size, link)
            latency = 0.0 if link is None else link[1]
            spans = [(span.chunk_tokens, span.makespan(group_size, per_token, latency))
                     for span in self._all()]
        best_size, best = 0, math.inf
        for size, value in spans:
            if value < best * (1.0 - 1e-9):
                best_size, best = size, value
        return best_size, best


def choose_chunk(cost: CostModel, n: int, cached: int, group_size: int,
                 config: CPPConfig, link: Link = None) -> tuple[int, float]:
    """``(chunk size, makespan)`` of the plan :func:`plan_cpp_for` would build, without
    building it (what a policy pricing one group needs; :class:`ChunkPricer` for
    several)."""
    return ChunkPricer(cost, n, cached, config).choose(group_size, link)


def plan_cpp_for(cost: CostModel, n: int, cached: int, group_size: int,
                 config: CPPConfig, link: Link = None) -> CPPPlan:
    """The plan with ``config``'s chunk size, or (``chunk_tokens`` 0) the one of
    ``chunk_choices`` with the shortest makespan (the smaller size on a tie, so
    sizes within 1e-9 of each other count as tied)."""
    size, _ = choose_chunk(cost, n, cached, group_size, config, link)
    return plan_cpp(cost, n, cached, group_size, size, link)
