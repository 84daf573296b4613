"""The routed experts on CUDA: two Triton grouped GEMMs over (token, expert) pairs
sorted by expert, with no host synchronisation, so a decode step with a
mixture-of-experts layer can be captured in a CUDA graph.

`align` sorts the step's pairs by expert and pads each expert's run to a multiple
of BLOCK_M with a sentinel, all with device ops into buffers of a size fixed by the
batch (T x K pairs plus E x (BLOCK_M - 1) padding): every block of BLOCK_M sorted
pairs then belongs to one expert. `_gate_up_kernel` computes, per block, the
activation of x @ W13[e].T (its gate and up tiles side by side, so the activation is
fused in); `_down_kernel` multiplies that by W2[e].T, scales by the routing weight
and writes each pair's row; the K rows of a token are summed at the end. Blocks past
the step's last expert exit at once. Interpreter-tested on CPU (TRITON_INTERPRET=1)
against the CPU op (fused_experts.py).

Quantized experts are widened tile by tile as they are loaded (`_weight_tile`), as
vLLM's w8a16 / w4a16 fused-MoE kernels do: int8 values or 4-bit codes two to a byte
(uint8), times a float32 scale per group of GROUP inputs (a scale per row is one group
of all of them: --quantization int8), plus a minimum where the type has one (a GGUF's
K-quants, --quantization int4)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve.engine.kernels.attention.triton.common import dot_precision, upcast_on_load

BLOCK_M = 16  # pairs per block: decode steps route few tokens to each expert
BLOCK_N = 64
BLOCK_K = 32


def align(topk_ids: torch.Tensor, num_experts: int, first_expert: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P], block_expert [P / block_m]): pair indices (t * K + k) grouped
    by local expert, each group padded to block_m with the sentinel T * K; the local
    expert of each block, num_experts for blocks past the last. Pairs routed to
    another rank's experts are left out. P is fixed by T, K and E alone."""
    n = topk_ids.numel()
    dev = topk_ids.device
    local = topk_ids.reshape(-1).long() - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, local, torch.ones_like(local))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0  # other ranks' pairs take no room
    ends = padded.cumsum(0)
    starts = ends - padded
    size = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    order = torch.sort(local, stable=True).indices
    sorted_local = local[order]
    first_sorted = counts.cumsum(0) - counts  # where each expert's pairs begin in `order`
    rank = torch.arange(n, device=dev) - first_sorted[sorted_local]
    dest = torch.where(sorted_local < num_experts, starts[sorted_local] + rank, size)
    sorted_pairs = torch.full((size + 1,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.int())
    block_start = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(ends[:num_experts], block_start, right=True)
    return sorted_pairs[:size], block_expert.int()


@triton.jit
def _swiglu(gate, up, ACTIVATION: tl.constexpr, limit, alpha):
    if ACTIVATION == "silu":
        return gate * tl.sigmoid(gate) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))


@triton.jit
def _weight_tile(w_base, s_base, m_base, offs_n, k0, n_len, mask, stride_wn, stride_sn,
                 BLOCK_K: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr,
                 HAS_MIN: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of an expert's W^T (rows offs_n of n_len, inputs k0
    on): as stored (QUANT 0), or widened to float32 from int8 values (1) or 4-bit
    codes two to a byte, input 2j in the low nibble (2), w = q * scale + min per group
    of GROUP inputs (scales [N, K / GROUP] behind s_base, minimums behind m_base)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    # (one return: the constexpr branches give the tile different types)
    if QUANT == 0:
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask,
                    other=0.0)
    else:
        if QUANT == 1:
            q = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask,
                        other=0).to(tl.float32)
        else:
            byte = tl.load(w_base + offs_n[None, :] * stride_wn + (offs_k // 2)[:, None],
                           mask=mask, other=0).to(tl.int32)
            q = ((byte >> ((offs_k % 2) * 4)[:, None]) & 15).to(tl.float32)
        if GROUP % BLOCK_K == 0:  # the tile in one group a row: [BLOCK_N] factors
            group = offs_n * stride_sn + k0 // GROUP
            n_ok = offs_n < n_len
            w = q * tl.load(s_base + group, mask=n_ok, other=0.0)[None, :]
            if HAS_MIN:
                w += tl.load(m_base + group, mask=n_ok, other=0.0)[None, :]
        else:  # (a K-quant's groups of 16)
            group = offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None]
            w = q * tl.load(s_base + group, mask=mask, other=0.0)
            if HAS_MIN:
                w += tl.load(m_base + group, mask=mask, other=0.0)
    return w


@triton.jit
def _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block of sorted pairs: (its expert, the rows of the sorted
    buffer, the pairs there, which are real rather than padding)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + rows)
    return expert, rows, pairs, pairs < num_pairs


# The pair count changes from step to step: specialised (equal to 1, divisible by
# 16), each value would be a compile of its own mid-serving. The group scales'
# strides (groups a row: 24 for Qwen3-30B-A3B's experts, 448 for Mixtral's) are
# left alone too: one compile a variant whatever the model.
@triton.jit(do_not_specialize=["num_pairs", "stride_se", "stride_sn"])
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, s_ptr, m_ptr, out_ptr, pairs_ptr, block_expert_ptr,
                    num_pairs, hidden, inter, top_k, limit, alpha,
                    stride_x, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_o,
                    NUM_EXPERTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr,
                    HAS_MIN: tl.constexpr):
    pid_n = tl.program_id(1)
    expert, rows, pairs, valid = _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert >= NUM_EXPERTS:  # a block past the last expert's pairs
        return
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    s_base, m_base = s_ptr + expert * stride_se, m_ptr + expert * stride_se
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = _weight_tile(w_base, s_base, m_base, offs_n, k0, 2 * inter, w_mask, stride_wn,
                          stride_sn, BLOCK_K, GROUP, QUANT, HAS_MIN)
        wu = _weight_tile(w_base, s_base, m_base, offs_n + inter, k0, 2 * inter, w_mask,
                          stride_wn, stride_sn, BLOCK_K, GROUP, QUANT, HAS_MIN)
        if UPCAST:
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        elif QUANT:  # widened weights meet the activations in their dtype
            wg, wu = wg.to(x.dtype), wu.to(x.dtype)
        acc_g += tl.dot(x, wg, input_precision=DOT_PRECISION)
        acc_u += tl.dot(x, wu, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)[None, :]
        acc_u += tl.load(b_ptr + expert * stride_be + inter + offs_n, mask=n_ok,
                         other=0.0)[None, :]
    h = _swiglu(acc_g, acc_u, ACTIVATION, limit, alpha)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + offs_n[None, :],
             h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "stride_se", "stride_sn"])
def _down_kernel(h_ptr, w_ptr, b_ptr, s_ptr, m_ptr, weights_ptr, out_ptr, pairs_ptr,
                 block_expert_ptr, num_pairs, hidden, inter, stride_h, stride_we, stride_wn,
                 stride_be, stride_se, stride_sn, stride_o, NUM_EXPERTS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 GROUP: tl.constexpr, QUANT: tl.constexpr, HAS_MIN: tl.constexpr):
    pid_n = tl.program_id(1)
    expert, rows, pairs, valid = _block_pairs(pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    if expert >= NUM_EXPERTS:  # a block past the last expert's pairs
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    s_base, m_base = s_ptr + expert * stride_se, m_ptr + expert * stride_se
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_base, s_base, m_base, offs_n, k0, hidden,
                         k_ok[:, None] & n_ok[None, :], stride_wn, stride_sn, BLOCK_K, GROUP,
                         QUANT, HAS_MIN)
        if UPCAST:
            h, w = h.to(tl.float32), w.to(tl.float32)
        elif QUANT:
            w = w.to(h.dtype)
        acc += tl.dot(h, w, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_o + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def triton_fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor, first_expert: int,
                         b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                         activation: str = "silu", limit: float = 0.0, alpha: float = 0.0,
                         w13_quant: tuple = (None, None), w2_quant: tuple = (None, None)
                         ) -> torch.Tensor:
    """fused_experts.fused_experts's result, on the GPU (or Triton's interpreter).
    w13_quant, w2_quant: (scale, minimum) of quantized experts (fused_experts's
    meanings), (None, None) for float ones."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    pairs, block_expert = align(topk_ids, num_experts, first_expert, BLOCK_M)
    n = tokens * top_k
    h = torch.empty(len(pairs), inter, dtype=x.dtype, device=x.device)
    precision, upcast = dot_precision(x.dtype), upcast_on_load(x)
    bias = b13 is not None
    q13, q2 = _quant_args(w13, hidden, *w13_quant), _quant_args(w2, inter, *w2_quant)
    _gate_up_kernel[(len(block_expert), triton.cdiv(inter, BLOCK_N))](
        x, w13, b13 if bias else w13, q13.scale, q13.low, h, pairs, block_expert, n, hidden,
        inter, top_k, limit, alpha, x.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0) if bias else 0, *q13.strides, h.stride(0), NUM_EXPERTS=num_experts,
        HAS_BIAS=bias, ACTIVATION=activation, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, DOT_PRECISION=precision, UPCAST=upcast, **q13.flags)
    # Other ranks' pairs (expert parallelism) keep their zero rows.
    per_pair = torch.zeros(n, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(len(block_expert), triton.cdiv(hidden, BLOCK_N))](
        h, w2, b2 if bias else w2, q2.scale, q2.low, weights, per_pair, pairs, block_expert,
        n, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        b2.stride(0) if bias else 0, *q2.strides, per_pair.stride(0),
        NUM_EXPERTS=num_experts, HAS_BIAS=bias, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, DOT_PRECISION=precision, UPCAST=upcast, **q2.flags)
    return per_pair.view(tokens, top_k, hidden).sum(1).to(x.dtype)


class _Quant(NamedTuple):
    scale: torch.Tensor  # [E, N, G] float32 (the weights themselves when float)
    low: torch.Tensor  # the minimums, alike
    strides: tuple[int, int]  # of the scales' experts and rows
    flags: dict  # the kernels' GROUP, QUANT, HAS_MIN


def _quant_args(w: torch.Tensor, inputs: int, scale: torch.Tensor | None,
                low: torch.Tensor | None) -> _Quant:
    """A weight's quantization as the kernels take it: a scale per row ([E, N]) is
    one group of every input."""
    if scale is None:
        return _Quant(w, w, (0, 0), dict(GROUP=1, QUANT=0, HAS_MIN=False))
    if scale.dim() == 2:
        scale = scale[..., None]
    scale = scale.float().contiguous()
    low = low.float().contiguous() if low is not None else None
    quant = 2 if w.dtype == torch.uint8 else 1
    return _Quant(scale, low if low is not None else scale, (scale.stride(0), scale.stride(1)),
                  dict(GROUP=inputs // scale.shape[-1], QUANT=quant, HAS_MIN=low is not None))
