"""The routed experts of a mixture-of-experts layer, as one op: `kvserve::fused_experts`.

Each token picked top_k experts; the (token, expert) pairs are sorted by expert
(one sort), so each expert's tokens are one run of rows, and two grouped GEMMs
(torch._grouped_mm: every expert's rows times its own weights, in one call each)
give every pair's SwiGLU MLP; the weighted results are added back per token. No
per-token and no per-expert Python (transformers loops over the experts and builds
a one-hot [E, K, T] mask to find each one's tokens).

It is a custom op, as attention is, so that torch.compile treats the data-dependent
loop as one opaque call and compiles the rest of the decoder around it. Under
expert parallelism a rank holds experts [first_expert, first_expert + E_local):
pairs routed elsewhere are skipped here and the ranks' outputs summed by the caller."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.engine.kernels.cpu.build import loaded as cpu_kernels_loaded
from kvserve.engine.kernels.cpu.packing import DOT_BLOCK
from kvserve.engine.kernels.group_quant import code_values, group_weights


def gated(gate_up: torch.Tensor, activation: str, limit: float, alpha: float):
    """The experts' gated activation of [.., 2I] (gate features, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    # gpt-oss's clamped SwiGLU
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@torch.library.custom_op("kvserve::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, first_expert: int,
                  b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                  activation: str = "silu", limit: float = 0.0, alpha: float = 0.0,
                  w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None,
                  w13_min: Optional[torch.Tensor] = None,
                  w2_min: Optional[torch.Tensor] = None,
                  int8_inputs: bool = False) -> torch.Tensor:
    """x [T, H]; topk_ids [T, K] (global expert ids) and topk_weights [T, K] (any
    float dtype: the product is taken in it, then cast to x's); w13 [E, 2I, H] (gate
    rows, then up rows), w2 [E, H, I]; b13 [E, 2I], b2 [E, H]: biases, if any;
    activation, limit, alpha: `gated`'s; w13_scale [E, 2I], w2_scale [E, H]: int8
    experts' scales per output row (w = q * scale), None for float experts; or
    [E, N, G] float32, a scale per group of K / G inputs (a GGUF's blocks, read as
    w = q * scale + min), with w13_min / w2_min [E, N, G] where the type has
    minimums, and 4-bit codes two to a byte where w13 / w2 are uint8 (code_values).
    int8_inputs: int8 experts with row scales (--quantization int8) may meet x
    quantized to int8 in blocks of 32 inputs, as llama.cpp's Q8_0 experts do
    (kvserve::expert_linear, up to DOTS_MAX_ROWS rows an expert). Returns sum_k
    weight_k * expert_k(x): [T, H]. On CUDA: the Triton grouped GEMMs
    (triton_experts.py), which a CUDA graph can capture; here the pairs' counts are
    read on the host, and few rows an expert of SiLU experts without biases go to
    kvserve::moe_experts (engine/kernels/cpu/moe_experts.cpp: these same steps in
    one call, the weighted sum in float32)."""
    if x.device.type == "cuda":
        from kvserve.engine.kernels.moe.triton_experts import triton_fused_experts

        return triton_fused_experts(x, topk_ids, topk_weights, w13, w2, first_expert, b13,
                                    b2, activation, limit, alpha, (w13_scale, w13_min),
                                    (w2_scale, w2_min))
    return _on_cpu(x, topk_ids, topk_weights, w13, w2, first_expert, b13, b2, activation,
                   limit, alpha, w13_scale, w2_scale, w13_min, w2_min, int8_inputs)


def _on_cpu(x, topk_ids, topk_weights, w13, w2, first_expert, b13, b2, activation, limit,
            alpha, w13_scale, w2_scale, w13_min, w2_min, int8_inputs) -> torch.Tensor:
    """fused_experts on CPU: kvserve's kernels in one call where they take it, else
    the pairs sorted by expert here and their products by the kernel (few rows an
    expert) or torch's GEMMs."""
    int8_inputs, dots = _dot_products(x, w13, w2, w13_scale, int8_inputs)
    if in_one_call(activation, b13, b2, (w13, w13_scale), (w2, w2_scale)):
        y = _moe_experts(x, topk_ids, topk_weights, w13, w2, first_expert, w13_scale,
                         w2_scale, w13_min, w2_min, int8_inputs,
                         DOTS_MAX_ROWS if dots else EXPERT_LINEAR_MAX_ROWS)
        if y is not None:
            return y
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    local = topk_ids.reshape(-1) - first_expert
    outside = (local < 0) | (local >= num_experts)
    # Pairs routed to another rank's experts sort last, under the id `num_experts`.
    sorted_ids, order = local.masked_fill(outside, num_experts).sort(stable=True)
    counts = torch.bincount(sorted_ids, minlength=num_experts + 1)[:num_experts]
    pairs = order[:int(counts.sum())]
    tokens = pairs // top_k
    if _few_rows(len(pairs), counts, dots, (w13, w13_scale), (w2, w2_scale)):
        # kvserve's CPU kernel for decode steps' narrow products (weights where they lie)
        h = _expert_linear(x[tokens], w13, b13, counts, w13_scale, w13_min, int8_inputs)
        a = gated(h, activation, limit, alpha)
        if x.dtype == w2.dtype == torch.bfloat16:  # as torch's bf16 GEMMs would round it
            a = a.to(torch.bfloat16)
        y = _expert_linear(a, w2, b2, counts, w2_scale, w2_min, int8_inputs)
    elif GROUPED and w13_scale is None:
        h = _grouped(x[tokens], w13, b13, counts)
        y = _grouped(gated(h, activation, limit, alpha), w2, b2, counts)
    else:  # (int8 experts: each read as int8 where few rows meet it, see _int8_linear)
        y = _per_expert(x, tokens, w13, w2, b13, b2, counts.tolist(), activation, limit,
                        alpha, (w13_scale, w13_min), (w2_scale, w2_min))
    y = y * topk_weights.reshape(-1)[pairs, None]
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def _dot_products(x, w13, w2, w13_scale, int8_inputs: bool) -> tuple[bool, bool]:
    """(int8_inputs where the kernel can take them: int8 experts with row scales and
    inputs in whole blocks; whether it takes dot products, int8 or bf16 ones)."""
    int8_inputs = int8_inputs and w13_scale is not None and w13_scale.dim() == 2 and \
        w13.shape[-1] % DOT_BLOCK == 0 and w2.shape[-1] % DOT_BLOCK == 0
    dots = int8_inputs or (x.dtype == w13.dtype == w2.dtype == torch.bfloat16 and _bf16_dots())
    return int8_inputs, dots


def one_token_moe_experts(x, topk_ids, topk_weights, w13, w2, first_expert, w13_scale,
                          w2_scale, w13_min, w2_min, int8_inputs: bool) -> torch.Tensor:
    """kvserve::moe_experts itself for one token (x [1, H]) in a compiled graph, for
    experts it takes in one call (in_one_call): a C++ op the graph calls as it is,
    where kvserve::fused_experts's Python implementation cost ~70 us a layer around
    it (~1.6 ms a batch-1 step over 24 layers). One token's pairs are one row an
    expert, so it never declines them (its fake, engine/kernels/cpu/packing.py,
    says [1, H])."""
    int8_inputs, dots = _dot_products(x, w13, w2, w13_scale, int8_inputs)
    return torch.ops.kvserve.moe_experts(x, topk_ids, topk_weights, w13, w2, first_expert,
                                         w13_scale, w2_scale, w13_min, w2_min, int8_inputs,
                                         DOTS_MAX_ROWS if dots else EXPERT_LINEAR_MAX_ROWS)


# Rows an active expert takes on average up to which kvserve's CPU kernel
# (kvserve::expert_linear, engine/kernels/cpu/expert_linear.cpp) runs the experts:
# decode steps' narrow products, bound by reading the weights, which it does at ~20
# GB/s where torch's grouped GEMM read bf16 experts at ~11 (16 tokens, 64 experts of
# 1024 x 384, top-8, 2-core Zen 4: 7.9 against 11.9 ms a layer); from ~8 rows an
# expert on (64 tokens: 16.8 against 15.6 ms) oneDNN's GEMMs are faster
# (bench/moe_split.py, measured before the kernel read its rows in order: it now
# reads 16 tokens' bf16 experts from memory at ~27-29 GB/s, bench/moe_from_memory.py).
EXPERT_LINEAR_MAX_ROWS = 6
# The same where the kernel takes its products as dot products rather than widening
# each weight: int8 experts meeting x quantized to int8 (int8_inputs; 4 products an
# instruction with AVX-512 VNNI: 8.4 against 17.4 ms for torch's widening at 16 rows
# an expert, 14.5 against 16.9 at 32, w13 of the same 64 experts), and bf16 experts
# meeting bf16 rows where the CPU has AVX-512 BF16 (7.6 against torch's grouped
# GEMM's 11.3 ms at 16 rows, 14.5 against 17.3 at 32, even at 48-64).
DOTS_MAX_ROWS = 32
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)


def _bf16_dots() -> bool:
    """Whether the kernel takes bf16 rows against bf16 experts in AVX-512 BF16's dot
    products on this CPU (asked once the kernels are loaded; without them, no)."""
    global _BF16_DOTS
    if _BF16_DOTS is None:
        if not cpu_kernels_loaded():
            return False
        _BF16_DOTS = bool(torch.ops.kvserve.expert_bf16_dots())
    return _BF16_DOTS


_BF16_DOTS: bool | None = None
# Asked once: a constant to a traced graph. Marked as torch._dynamo.assume_constant_result
# marks a function (tests/engine/test_startup_imports.py checks the two agree), because
# importing Dynamo for its decorator took ~1.1 s of every importer's start, the front
# end's too, before it spawns the engine process.
_bf16_dots._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _moe_experts(*args) -> torch.Tensor | None:
    """kvserve::moe_experts (kvserve's CPU kernels for few rows an expert, routing
    and all, in one call), or None where more rows meet the experts than it takes."""
    y = torch.ops.kvserve.moe_experts(*args)
    return y if y.dim() == 2 else None


def in_one_call(activation: str, b13: torch.Tensor | None, b2: torch.Tensor | None,
                *experts) -> bool:
    """Whether kvserve::moe_experts takes these experts (few rows an expert): SiLU
    experts without biases that kvserve's kernel reads (experts: (weight, scale))."""
    return activation == "silu" and b13 is None and b2 is None and kernel_reads(*experts)


def kernel_reads(*experts) -> bool:
    """Whether kvserve's kernel can take these experts: loaded (engine/kernels/cpu:
    on x86 CPUs with AVX2 and FMA, unless --cpu-kernels torch) and reading them
    (float32, bf16, int8 with a scale per row, or a GGUF's int8 values or 4-bit codes
    with group scales, groups of a multiple of 8 inputs; experts: (weight, scale)
    pairs)."""
    for w, scale in experts:
        inputs = w.shape[-1] * (2 if w.dtype == torch.uint8 else 1)
        if w.dtype not in _KERNEL_DTYPES or not w.is_contiguous() or (
                scale is not None and scale.dim() == 3 and inputs % (8 * scale.shape[-1])):
            return False
    return cpu_kernels_loaded()


def _few_rows(pairs: int, counts: torch.Tensor, dots: bool, *experts) -> bool:
    """Whether kvserve's kernel takes this call: experts it reads, and few rows per
    active expert (more where it takes dot products: `dots`)."""
    most = DOTS_MAX_ROWS if dots else EXPERT_LINEAR_MAX_ROWS
    return kernel_reads(*experts) and pairs <= most * int(counts.count_nonzero())


def _expert_linear(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                   counts: torch.Tensor, scale: torch.Tensor | None,
                   low: torch.Tensor | None = None, int8_inputs: bool = False) -> torch.Tensor:
    """_grouped's product by kvserve::expert_linear, in float32 (bf16 rows meet bf16
    experts as they are: two products an instruction with AVX-512 BF16)."""
    if not rows.dtype == w.dtype == torch.bfloat16:
        rows = rows.float()
    y = torch.ops.kvserve.expert_linear(rows, counts, w,
                                        None if scale is None else scale.float(),
                                        None if low is None else low.float(), int8_inputs)
    return _plus_bias(y, b, counts)


# torch's grouped GEMM (one call for every expert's rows; on CPU since torch 2.9),
# reading the experts' [E, N, K] weights as they lie (transposed views): 1.3-1.4x the
# per-expert loop at 1-32 tokens of 64 experts (1024 x 768 each, bf16, 2-core Zen 4).
GROUPED = hasattr(torch, "_grouped_mm")


def _grouped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
             counts: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows each, in order) times their
    expert's w [E, N, K], plus its bias."""
    y = torch._grouped_mm(x, w.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    return _plus_bias(y, b, counts)


def _plus_bias(y: torch.Tensor, b: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (counts[e] rows each) plus their expert's bias."""
    return y if b is None else y + b.to(y.dtype).repeat_interleave(counts, dim=0)


# Rows up to which torch's int8 CPU kernel (bf16/fp16 activations, int8 weights read
# as they lie) beats widening the expert's weights for a float GEMM: as for
# Int8Linear (bench/results/cpu_int8_kernels_2026-11-24.md).
INT8PACK_MAX_ROWS = 8


def _int8_linear(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 low: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] times one int8 expert's q [N, K]: w = q * scale per row, or per
    group (scale, low [N, G]: expanded for the call, as GroupInt8Linear does)."""
    if scale.dim() == 2:
        return F.linear(rows, group_weights(q, scale, low, rows.dtype))
    if rows.dtype in (torch.bfloat16, torch.float16) and rows.shape[0] <= INT8PACK_MAX_ROWS:
        return torch.ops.aten._weight_int8pack_mm(rows, q, scale.to(rows.dtype))
    return F.linear(rows, q.to(rows.dtype)) * scale.to(rows.dtype)


def _per_expert(x, tokens, w13, w2, b13, b2, counts: list[int], activation, limit, alpha,
                w13_quant=(None, None), w2_quant=(None, None)):
    """The same, one GEMM pair per active expert (torch without _grouped_mm, and
    int8 experts: no grouped GEMM reads int8, and widening every active expert for
    one cost 3.5x bf16's bytes). *_quant: (scale, min) of int8 experts."""
    def linear(rows, w, b, quant, expert):
        scale, low = quant
        if scale is None:
            return F.linear(rows, w[expert], None if b is None else b[expert])
        y = _int8_linear(rows, w[expert], scale[expert],
                         None if low is None else low[expert])
        return y if b is None else y + b[expert]

    out, start = [], 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        start += n
        h = gated(linear(x[rows], w13, b13, w13_quant, expert), activation, limit, alpha)
        out.append(linear(h, w2, b2, w2_quant, expert))
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


@fused_experts.register_fake
def _fused_experts_shape(x, topk_ids, topk_weights, w13, w2, first_expert, b13=None,
                         b2=None, activation="silu", limit=0.0, alpha=0.0, w13_scale=None,
                         w2_scale=None, w13_min=None, w2_min=None, int8_inputs=False):
    return torch.empty_like(x)


def one_token_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, first_expert: int,
                      b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      activation: str = "silu", limit: float = 0.0, alpha: float = 0.0,
                      w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None,
                      w13_min: torch.Tensor | None = None,
                      w2_min: torch.Tensor | None = None) -> torch.Tensor:
    """fused_experts for one token (x [1, H]) as plain ops, for a compiled batch-1
    decode graph: each chosen expert's rows indexed where they lie and reduced
    against the token (Inductor fuses the indexing into its loops, as for the paged
    decode attention), in float32. 0.66 ms against the op's 2.29 for 8 of 64 experts
    of 1024 x 384 in bf16 on a 2-core Zen 4 (29 against 8 GB/s of weights). int8
    experts are read as int8 there, their scales applied to the row sums (or to
    each group's sum, with the minimums times the group's inputs)."""
    local = topk_ids[0] - first_expert  # [K]
    held = (local >= 0) & (local < w13.shape[0])  # other ranks' experts weigh 0
    local = local.clamp(0, w13.shape[0] - 1)

    def picked(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[local].float()

    h = _rows_dot(x[0].float(), w13[local], picked(w13_scale), picked(w13_min))  # [K, 2I]
    if b13 is not None:
        h = h + b13[local].float()
    a = gated(h, activation, limit, alpha)  # [K, I]
    y = _rows_dot(a.unsqueeze(1), w2[local], picked(w2_scale), picked(w2_min))  # [K, H]
    if b2 is not None:
        y = y + b2[local].float()
    weights = topk_weights[0].float() * held
    return (y * weights[:, None]).sum(0, keepdim=True).to(x.dtype)


def _rows_dot(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
              low: torch.Tensor | None) -> torch.Tensor:
    """x [.., K] (float32) against each row of w [k, N, K]: [k, N], in float32. int8
    rows: scale [k, N] per row, or [k, N, G] per group of K / G inputs (with low,
    the group's minimum, times the group's input sum)."""
    if scale is None or scale.dim() == 2:
        y = (x * w.float()).sum(-1)
        return y if scale is None else y * scale
    groups = x.unflatten(-1, (scale.shape[-1], -1))  # [.., G, K / G]
    y = ((groups * code_values(w).unflatten(-1, (scale.shape[-1], -1))).sum(-1)
         * scale).sum(-1)
    return y if low is None else y + (low * groups.sum(-1)).sum(-1)
