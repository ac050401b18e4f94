"""Measure prefill and decode times on a real GPU, to check the cost model's formulas.

    python benchmarks/gpu_prefill_calibration.py --out prefill-samples.json

Needs PyTorch and one CUDA GPU; nothing else from this project (the GPU machine may not
have it installed). Runs one tensor-parallel rank of a Llama-style decoder layer (by
default LLaMA3-70B at TP=8, the paper's node: 64 query heads and 8 KV heads of 128, model
dim 8192, MLP 28672, so each rank holds 8 query heads, 1 KV head and 3584 MLP columns)
in bf16 with random weights: RMSNorm, QKV projection, rotary embedding, attention of the
new tokens over the cached prefix and themselves (causal, FlashAttention through
``scaled_dot_product_attention``), output projection, RMSNorm, SwiGLU MLP, residuals.
A pass over ``new`` tokens with ``prefix`` tokens already cached is timed with CUDA
events over ``--stack`` layer calls in a row, captured once as a CUDA graph and replayed
(``--no-graphs``: launched eagerly, kernel by kernel), and the per-layer time times the
model's layers is what the node spends computing (every rank does the same work at
once). A long prompt prefilled chunk by chunk (``--chunked``: each chunk a pass over the
chunks before it, what a chunked-pipeline stage computes) and decode steps
(``--decode-grid``: a batch of sequences, one new token each over its cached context) are
timed the same way.

Not measured: the tensor-parallel all-reduces (two per layer; one GPU has no peer), the
sampler and the engine's scheduling. ``benchmarks/gpu_calibration_report.py`` compares
the samples with ``CostModel`` and fits its prefill efficiency terms.

Writes ``{"hardware": {...}, "model": {...}, "method": "...", "samples": [{"new",
"prefix", "layer_s", "compute_s", "cuda_graph"}, ...], "chunked_samples": [{"prompt",
"chunk", "passes", "compute_s", "cuda_graph"}, ...], "decode_samples": [{"batch",
"context", "layer_s", "step_s", "cuda_graph"}, ...]}``, whole after every sample;
prints a progress line per sample and a summary at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: (new tokens, cached prefix tokens): a sweep of pass sizes without a prefix, then
#: passes over prefixes of increasing length (reuse), then long prompts
DEFAULT_GRID: tuple[tuple[int, int], ...] = (
    tuple((x, 0) for x in (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                           8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072))
    + tuple((x, p) for p in (1024, 4096, 16384, 32768, 65536, 98304)
            for x in (256, 1024, 2048, 4096, 8192, 16384))
)


def pairs(text: str) -> tuple[tuple[int, int], ...]:
    """``'a:b,c:d'`` as ``((a, b), (c, d))``, every number a whole one at least 0 (the
    first at least 1); ``''``: none."""
    out = []
    for item in filter(None, text.split(",")):
        first, sep, second = item.partition(":")
        try:
            a, b = int(first), int(second)
        except ValueError:
            a = b = -1
        if not sep or a < 1 or b < 0:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not N:M with whole numbers N >= 1, M >= 0")
        out.append((a, b))
    return tuple(out)


def chunked_spec(text: str) -> tuple[int, tuple[int, ...]]:
    """``'prompt:chunk,chunk,...'``; ``''``: none (prompt 0)."""
    if not text:
        return 0, ()
    prompt, sep, sizes = text.partition(":")
    try:
        n, chunks = int(prompt), tuple(int(c) for c in sizes.split(","))
    except ValueError:
        n, chunks = 0, ()
    if not sep or n < 1 or not chunks or min(chunks) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PROMPT:CHUNK,CHUNK,... with whole numbers >= 1")
    return n, chunks


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the samples")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--d-model", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=28672)
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks of the node")
    ap.add_argument("--stack", type=int, default=4, help="layer calls timed in a row")
    ap.add_argument("--repeat", type=int, default=15, help="timed repetitions (median kept)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="stop sweeping after this many seconds (the samples so far are kept)")
    ap.add_argument("--grid", type=pairs, default=DEFAULT_GRID,
                    help="'new:prefix,...' instead of the default sweep")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="time each pass as a replayed CUDA graph (no launch overhead)")
    ap.add_argument("--chunked", type=chunked_spec, default="131072:1024,2048,4096,8192",
                    help="'prompt:chunk,...': the prompt prefilled chunk by chunk, each over "
                    "the chunks before it, as a pipeline stage computes it ('' for none)")
    ap.add_argument("--decode-grid", type=pairs, default="1:1024,1:32768,16:4096,64:4096,64:16384,"
                    "128:4096,128:16384,256:4096",
                    help="'batch:context,...' decode steps to time ('' for none)")
    return ap.parse_args(argv)


class RankLayer:
    """One tensor-parallel rank's share of a decoder layer, random bf16 weights."""

    def __init__(self, d: int, heads: int, kv_heads: int, mlp: int, tp: int,
                 dev: torch.device) -> None:
        if heads % tp or mlp % tp or heads % kv_heads:
            raise SystemExit("heads and mlp must split evenly over --tp ranks")
        self.hd = d // heads
        self.hq = heads // tp
        self.hkv = max(1, kv_heads // tp)
        self.mlp = mlp // tp
        dt = torch.bfloat16
        s = 1.0 / math.sqrt(d)
        self.w_qkv = torch.randn(d, (self.hq + 2 * self.hkv) * self.hd, device=dev, dtype=dt) * s
        self.w_o = torch.randn(self.hq * self.hd, d, device=dev, dtype=dt) * s
        self.w_gu = torch.randn(d, 2 * self.mlp, device=dev, dtype=dt) * s
        self.w_down = torch.randn(self.mlp, d, device=dev, dtype=dt) * (1.0 / math.sqrt(self.mlp))
        self.norm1 = torch.ones(d, device=dev, dtype=dt)
        self.norm2 = torch.ones(d, device=dev, dtype=dt)
        #: grouped-query attention inside the kernel (else KV heads are copied out)
        self.native_gqa = True

    def rope(self, start: int, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.hd // 2
        inv = 1.0 / (500000.0 ** (torch.arange(half, device=dev, dtype=torch.float32) / half))
        pos = torch.arange(start, start + n, device=dev, dtype=torch.float32)
        ang = torch.outer(pos, inv)
        return ang.cos().to(torch.bfloat16)[:, None, :], ang.sin().to(torch.bfloat16)[:, None, :]

    @staticmethod
    def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = t.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV projection and rotary embedding of ``x`` (tokens x d): q, k and v as
        (tokens, heads, head dim)."""
        t = x.shape[0]
        h = F.rms_norm(x, (x.shape[1],), self.norm1)
        q, k, v = (h @ self.w_qkv).split(
            [self.hq * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        return (self.rotate(q.view(t, self.hq, self.hd), cos, sin),
                self.rotate(k.view(t, self.hkv, self.hd), cos, sin),
                v.view(t, self.hkv, self.hd))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               **sdpa: Any) -> torch.Tensor:
        """Attention of (batch, query heads, tokens, head dim) queries over KV of
        (batch, KV heads, tokens, head dim), grouped in the kernel or by copying KV heads."""
        if not self.native_gqa:  # each KV head copied for its query heads
            k = k.repeat_interleave(self.hq // self.hkv, dim=1)
            v = v.repeat_interleave(self.hq // self.hkv, dim=1)
        else:
            sdpa["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, **sdpa)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Output projection of the attention ``o`` (tokens x heads*head dim), residual,
        norm, SwiGLU MLP, residual."""
        x = x + o @ self.w_o
        h = F.rms_norm(x, (x.shape[1],), self.norm2)
        g, u = (h @ self.w_gu).chunk(2, dim=-1)
        return x + (F.silu(g) * u) @ self.w_down

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                prefix: int, cos: torch.Tensor, sin: torch.Tensor, mask: Any) -> torch.Tensor:
        """Prefill: ``x`` (new tokens x d) over ``prefix`` cached tokens of one sequence
        (caches: KV heads x tokens x head dim); causal."""
        n = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        k_cache[:, prefix:prefix + n] = k.transpose(0, 1)
        v_cache[:, prefix:prefix + n] = v.transpose(0, 1)
        qq, kk, vv = q.transpose(0, 1)[None], k_cache[None, :, :prefix + n], \
            v_cache[None, :, :prefix + n]
        o = (self.attend(qq, kk, vv, is_causal=True) if mask is None
             else self.attend(qq, kk, vv, attn_mask=mask))
        return self.finish(x, o[0].transpose(0, 1).reshape(n, self.hq * self.hd))

    def decode(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               context: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Decode step: ``x`` (sequences x d), one new token each at position ``context``
        of its own cache (sequences x KV heads x tokens x head dim)."""
        batch = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        k_cache[:, :, context] = k
        v_cache[:, :, context] = v
        o = self.attend(q[:, :, None], k_cache, v_cache)
        return self.finish(x, o.reshape(batch, self.hq * self.hd))


def median_seconds(run: Callable[[], torch.Tensor], stack: int, repeat: int,
                   graphs: bool) -> tuple[float, bool]:
    """Median seconds per layer of ``run`` (``stack`` layers), and whether it ran as a
    CUDA graph: captured once and replayed, as engines run small passes, so kernel
    launches do not count; eager when capture fails or ``graphs`` is off."""
    step: Callable[[], object] = run
    graphed = False
    if graphs:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()  # warm-up outside the capture (workspaces, autotuning)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            step, graphed = graph.replay, True
        except RuntimeError as exc:
            print(f"  CUDA graph capture failed ({str(exc).splitlines()[0]}); eager", flush=True)
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(repeat + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1000.0 / stack)
    return sorted(times)[len(times) // 2], graphed


def time_pass(layer: RankLayer, new: int, prefix: int, d: int, stack: int, repeat: int,
              dev: torch.device, graphs: bool) -> tuple[float, bool]:
    """Median seconds of one layer over ``new`` tokens with ``prefix`` cached."""
    from torch.nn.attention.bias import causal_lower_right

    x = torch.randn(new, d, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(layer.hkv, prefix + new, layer.hd, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    cos, sin = layer.rope(prefix, new, dev)
    mask = None if prefix == 0 else causal_lower_right(new, prefix + new)

    def run() -> torch.Tensor:
        y = x
        for _ in range(stack):
            y = layer.forward(y, k_cache, v_cache, prefix, cos, sin, mask)
        return y

    return median_seconds(run, stack, repeat, graphs)


def time_decode(layer: RankLayer, batch: int, context: int, d: int, stack: int, repeat: int,
                dev: torch.device, graphs: bool) -> tuple[float, bool]:
    """Median seconds of one layer's decode step: ``batch`` sequences, one new token each,
    every one over ``context`` cached tokens (continuous batching's step)."""
    x = torch.randn(batch, d, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(batch, layer.hkv, context + 1, layer.hd, device=dev,
                          dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    cos, sin = layer.rope(context, 1, dev)

    def run() -> torch.Tensor:
        y = x
        for _ in range(stack):
            y = layer.decode(y, k_cache, v_cache, context, cos, sin)
        return y

    return median_seconds(run, stack, repeat, graphs)


def matmul_peak(dev: torch.device) -> float:
    """bf16 FLOP/s of an 8192-cubed matrix product (mean of 10 after 3 warm-ups)."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this script measures a real one", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    grid = args.grid
    props = torch.cuda.get_device_properties(dev)
    peak = matmul_peak(dev)
    print(f"{props.name}: bf16 matmul {peak / 1e12:.0f} TFLOP/s; {len(grid)} passes, "
          f"{args.layers} layers at TP={args.tp}", flush=True)
    layer = RankLayer(args.d_model, args.heads, args.kv_heads, args.mlp, args.tp, dev)
    with torch.inference_mode():
        try:
            time_pass(layer, 256, 256, args.d_model, 1, 1, dev, graphs=False)
        except (RuntimeError, TypeError) as exc:
            print(f"attention with enable_gqa failed ({exc}); copying KV heads instead",
                  flush=True)
            layer.native_gqa = False
    samples: list[dict[str, Any]] = []
    began = time.perf_counter()
    out: dict[str, Any] = {
        "hardware": {"gpu": props.name, "matmul_bf16_flops": peak, "tp": args.tp,
                     "torch": torch.__version__, "native_gqa": layer.native_gqa},
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                  "kv_heads": args.kv_heads, "mlp": args.mlp},
        "method": "one TP rank's decoder layer, random bf16 weights, CUDA-event median of "
                  f"{args.repeat} runs of {args.stack} layers"
                  f"{' replayed as a CUDA graph' if args.graphs else ' (eager)'}; "
                  "all-reduces not measured",
        "samples": samples,
    }

    def save() -> None:  # the file is whole after every sample
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    with torch.inference_mode():
        for i, (new, prefix) in enumerate(grid, 1):
            if time.perf_counter() - began > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {i - 1} of {len(grid)} passes",
                      flush=True)
                break
            try:
                layer_s, graphed = time_pass(layer, new, prefix, args.d_model, args.stack,
                                             args.repeat, dev, args.graphs)
            except torch.cuda.OutOfMemoryError:
                print(f"[{i}/{len(grid)}] new={new} prefix={prefix}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            compute_s = layer_s * args.layers
            samples.append({"new": new, "prefix": prefix, "layer_s": layer_s,
                            "compute_s": compute_s, "cuda_graph": graphed})
            print(f"[{i}/{len(grid)}] new={new:>6} prefix={prefix:>6}  "
                  f"layer {layer_s * 1e3:8.3f} ms  node {compute_s:8.3f} s", flush=True)
            save()
        chunked: list[dict[str, Any]] = []
        out["chunked_samples"] = chunked
        prompt, chunks = args.chunked
        for chunk in chunks:
            passes = []
            for start_tok in range(0, prompt, chunk):
                new = min(chunk, prompt - start_tok)
                layer_s, graphed = time_pass(layer, new, start_tok, args.d_model, 1,
                                             args.repeat, dev, args.graphs)
                passes.append(layer_s)
            total = sum(passes) * args.layers
            chunked.append({"prompt": prompt, "chunk": chunk, "passes": len(passes),
                            "compute_s": total, "cuda_graph": graphed})
            print(f"chunked prompt={prompt} chunk={chunk:>5}: {len(passes)} passes, "
                  f"node {total:8.3f} s", flush=True)
            save()
        decode: list[dict[str, Any]] = []
        out["decode_samples"] = decode
        for batch, context in args.decode_grid:
            try:
                layer_s, graphed = time_decode(layer, batch, context, args.d_model,
                                               args.stack, args.repeat, dev, args.graphs)
            except torch.cuda.OutOfMemoryError:
                print(f"decode batch={batch} context={context}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            decode.append({"batch": batch, "context": context, "layer_s": layer_s,
                           "step_s": layer_s * args.layers, "cuda_graph": graphed})
            print(f"decode batch={batch:>4} context={context:>6}  layer {layer_s * 1e3:7.3f} ms"
                  f"  step {layer_s * args.layers * 1e3:7.2f} ms", flush=True)
            save()
    print(f"{len(samples)} prefill, {len(chunked)} chunked and {len(decode)} decode samples in "
          f"{time.perf_counter() - began:.0f} s -> {args.out}")
    return 0 if samples else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
