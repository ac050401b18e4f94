"""The time of one engine step that batches prefill chunks with running decodes.

A vLLM or SGLang engine with chunked prefill runs every scheduled prompt chunk and every
running decode of a step in **one forward pass**: the weights are read once, the linear
layers see all the step's new tokens at once, and the fixed per-pass cost is paid once.
Both the colocated baseline of the simulator and the simulated worker price a step here,
from the cost model's primitives (:class:`~mooncake_conductor.cost.CostModel`):

- no prefill: ``decode_step_time(B, C)``, the cost model's decode step;
- with prefill chunks carrying ``x`` new tokens in all and ``F`` FLOPs (each chunk's
  ``flops(p_i + c_i) - flops(p_i)``, attention to its prompt's earlier tokens included):
  ``o_p + F / (G * mfu(x)) + share(B, C)``, where ``share`` is what the decodes add to a
  pass that already reads the weights (their KV reads or their FLOPs, whichever is larger).
  A step with one chunk and no decodes costs exactly ``prefill_compute_time(p + c, p)``;
- loading cached prefixes from host memory overlaps the pass layer by layer, as in the
  cost model's ``prefill_time``: the step takes the larger of the two.

So a step of eight 1,000-token prompts costs one pass of 8,000 new tokens (one fixed
cost, the MFU of 8,000 tokens), not eight passes of 1,000. The other way round, a prompt
longer than the step budget runs as several passes (:func:`chunked_prefill_time`), each
with its own fixed cost.
"""

from __future__ import annotations

from .cost import CostModel


def decode_share_time(cost: CostModel, batch: int, context_tokens: int) -> float:
    """What ``batch`` decodes with ``context_tokens`` of KV add to a pass that already
    reads the weights: their KV reads or their FLOPs, whichever is larger."""
    if batch <= 0:
        return 0.0
    _, kv_bytes, hbm, flops_seq, attn_ctx, peak, _ = cost.decode_constants()
    mem = context_tokens * kv_bytes / hbm
    compute = (batch * flops_seq + context_tokens * attn_ctx) / peak
    return max(mem, compute)


def mixed_step_time(cost: CostModel, batch: int, context_tokens: int, prefill_flops: float,
                    prefill_tokens: int, load_tokens: int = 0) -> float:
    """One engine step: ``batch`` decodes holding ``context_tokens`` of KV, prefill chunks
    of ``prefill_tokens`` new tokens costing ``prefill_flops``, and ``load_tokens`` of
    cached prefix loaded from host memory during the pass (formula in the module doc)."""
    if prefill_tokens <= 0:
        step = cost.decode_step_time(batch, context_tokens)
    else:
        step = (cost.prefill_overhead_s + prefill_flops / cost.prefill_flops_rate(prefill_tokens)
                + decode_share_time(cost, batch, context_tokens))
    return max(step, cost.h2d_time(load_tokens)) if load_tokens > 0 else step


def chunked_prefill_time(cost: CostModel, n: int, cached: int, chunk_tokens: int,
                         cached_in_hbm: int = 0) -> float:
    """A prompt of ``n`` tokens (``cached`` of them reused) alone on an engine whose steps
    carry at most ``chunk_tokens`` new tokens: ``ceil(new / chunk_tokens)`` passes, each
    the prefill of its chunk with the prompt's earlier tokens in KV (a fixed cost per pass,
    the MFU of the chunk). Loading the cached prefix from host memory overlaps the passes.
    ``chunk_tokens`` 0, or a prompt that fits one step: ``cost.prefill_time``."""
    cached = min(max(cached, 0), n)
    if chunk_tokens <= 0 or n - cached <= chunk_tokens:
        return cost.prefill_time(n, cached, cached_in_hbm)
    compute = 0.0
    for start in range(cached, n, chunk_tokens):
        compute += cost.prefill_compute_time(min(n, start + chunk_tokens), start)
    load = cost.h2d_time(cached - min(cached_in_hbm, cached))
    return compute if compute >= load else load
