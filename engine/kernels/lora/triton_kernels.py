"""The batched LoRA product as Triton kernels (Punica's BGMV: one adapter slot per
token, gathered from the stacked buffers): a shrink kernel, x [T, in] -> [T, r] in
fp32, one program per token; an expand kernel adding [T, r] @ B[slot] into y (B
stored transposed, [slots, r, out]), one program per token and block of outputs. Tokens with slot -1 cost one load and leave y
alone. Vector products (tl.sum), not tl.dot: a decode token is one row, below the
16 rows tl.dot needs; a segment kernel (SGMV) for long prompt chunks is the next step.

Offsets are int64 (the program id and the slot widened before any product, as in
the attention kernels): token x stride passes 2**31 at, e.g., 16k tokens of a
128k-wide output, where int32 products would wrap and address another token's row.

Run on CPU through Triton's interpreter in the tests; their speed is measured on
the GPU (bench/gpu_session.sh)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_IN = 128
BLOCK_OUT = 64


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, tmp_ptr, IN, R, stride_x, stride_as, stride_ar,
            stride_tmp, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for i0 in range(0, IN, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            x = tl.load(x_ptr + t * stride_x + i, mask=i < IN, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + i[None, :],
                        mask=(r[:, None] < R) & (i[None, :] < IN), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(tmp_ptr + t * stride_tmp + r, acc, mask=r < R)


@triton.jit
def _expand(tmp_ptr, b_ptr, slots_ptr, y_ptr, OUT, R, stride_tmp, stride_bs, stride_br,
            stride_y, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        r = tl.arange(0, BLOCK_R)
        shrunk = tl.load(tmp_ptr + t * stride_tmp + r, mask=r < R, other=0.0)
        # B[slot] is [rank, out]: contiguous along the outputs each program writes.
        b = tl.load(b_ptr + slot * stride_bs + r[None, :] * stride_br + o[:, None],
                    mask=(o[:, None] < OUT) & (r[None, :] < R), other=0.0).to(tl.float32)
        delta = tl.sum(b * shrunk[None, :], axis=1)
        y = tl.load(y_ptr + t * stride_y + o, mask=o < OUT, other=0.0)
        tl.store(y_ptr + t * stride_y + o, (y.to(tl.float32) + delta).to(y.dtype),
                 mask=o < OUT)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                    b_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """As batched.add_lora: y [T, out] += x @ A[slot].T @ B[slot] per token (a_stack
    [slots, rank, in], b_stack [slots, rank, out])."""
    for name, t in (("y", y), ("x", x), ("a_stack", a_stack), ("b_stack", b_stack)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    tokens, fan_in = x.shape
    rank, fan_out = a_stack.shape[1], b_stack.shape[2]
    if tokens == 0:
        return y
    slots = slots.to(torch.int32)
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(rank)
    _shrink[(tokens,)](x, a_stack, slots, shrunk, fan_in, rank, x.stride(0),
                       a_stack.stride(0), a_stack.stride(1), shrunk.stride(0),
                       BLOCK_R=block_r, BLOCK_I=BLOCK_IN)
    _expand[(tokens, triton.cdiv(fan_out, BLOCK_OUT))](
        shrunk, b_stack, slots, y, fan_out, rank, shrunk.stride(0), b_stack.stride(0),
        b_stack.stride(1), y.stride(0), BLOCK_R=block_r, BLOCK_O=BLOCK_OUT)
    return y
