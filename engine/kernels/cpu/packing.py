"""Weights in the layout kvserve::packed_linear reads (packed_gemm.cpp), and the op
as the model and torch.compile call it.

A weight [N, K] becomes panels of 16 output columns, [ceil(N / 16), K, 16] (the last
panel padded with zeros), of one of these kinds:
- float32, in column order;
- bfloat16, where every value of a float weight is exact in bf16, the 16 columns
  ordered 0, 8, 1, 9, ... 7, 15 so that 32-bit word j of a row holds column j in its
  low half and column j + 8 in its high half;
- int8, in column order, with one float32 scale per output column (--quantization
  int8) or a float16 scale per group of inputs (GGUF's Q8_0);
- int4 pairs, [P, K, 8] uint8 whose byte j holds column j in its low nibble and
  column j + 8 in its high one, with a float16 scale and minimum per group of inputs
  (GGUF's Q4_1, --quantization int4: w = q * scale + min), or a scale alone where
  every minimum is -8 times its scale (symmetric: GGUF's Q4_0, --quantization
  int4-sym: w = (q - 8) * scale), which the kernel derives instead of reading.
A bf16 model's float weight on a CPU with AVX512-BF16 is packed in bf16 pair panels
instead, [P, K / 2, 32], for kvserve::bf16_linear (bf16_pairs.py).
A float weight whose every group of 32 inputs is exactly a Q4_1 or Q8_0 block's
values (a GGUF's quantized blocks expanded to floats, as the default model's
safetensors are) is packed as int4 or int8: the same values in fewer bytes.
Group scales and minimums are [P, K / group, 16] float16."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import nn

from kvserve.engine.kernels.cpu.bf16_pairs import (bf16_linear, is_pairs, pack_bf16_pairs,
                                                   pairs_rows, pairs_values)
from kvserve.engine.platform.device import cpu_flags

PANEL = 16
HALF = PANEL // 2
# Column order within a bf16 panel row (see above); its inverse restores 0..15.
BF16_ORDER = torch.tensor([j + half for j in range(HALF) for half in (0, HALF)])
# Inputs a group shares a scale (and minimum) over when a float weight turns out to
# be quantized blocks' values (GGUF's Q8_0 and Q4_1 blocks).
EXACT_GROUP = 32
# Rows checked first: a weight that is not on a grid is told in a few rows, not all.
PROBE_ROWS = 16


class Packed(NamedTuple):
    """A packed weight: panels, and the scales (and minimums) quantized ones need."""
    panels: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self if t is not None)


def exact_in_bf16(weight: torch.Tensor) -> bool:
    return bool(torch.equal(weight.to(torch.bfloat16).float(), weight))


def _blocks(weight: torch.Tensor, group: int, exact) -> torch.Tensor | None:
    """weight [N, K] as [N, K / group, group], or None where K has no whole groups or
    `exact` already fails on the first rows."""
    n, k = weight.shape
    if k == 0 or k % group:
        return None
    if n > PROBE_ROWS and exact(weight[:PROBE_ROWS], group) is None:
        return None
    return weight.reshape(n, k // group, group)


def exact_int8_groups(weight: torch.Tensor, group: int = EXACT_GROUP
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, scales [K / group, N] float16) with weight == q * scale
    exactly, where every group of `group` inputs of the float weight is int8 values
    of one float16 scale whose largest magnitude is 127 (a Q8_0 table expanded);
    else None."""
    groups = _blocks(weight, group, exact_int8_groups)
    if groups is None:
        return None
    q, steps, scales = _q8_0(groups)
    if not torch.isfinite(q).all() or q.abs().max() > 127 or not torch.equal(q * steps, groups):
        return None
    return q.to(torch.int8).reshape(weight.shape), scales.t().contiguous()


def round_int8_groups(weight: torch.Tensor, group: int = EXACT_GROUP
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """GGUF's Q8_0 rounding of a float weight: (q [N, K] int8, scales [K / group, N]
    float16), each group of `group` inputs rounded to the nearest of 255 levels of
    one float16 scale, max|w| / 127; None where K has no whole groups."""
    n, k = weight.shape
    if k == 0 or k % group:
        return None
    q, _, scales = _q8_0(weight.reshape(n, k // group, group))
    return q.clamp(-127, 127).to(torch.int8).reshape(n, k), scales.t().contiguous()


def _q8_0(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, G, group] -> (the values / step, rounded, as floats; each group's step,
    float32 [N, G, 1], 1 where the group is all zeros; the steps as float16 [N, G],
    0 there)."""
    scales = (groups.abs().amax(dim=2) / 127).half()
    steps = torch.where(scales > 0, scales, torch.ones_like(scales)).float()[..., None]
    return torch.round(groups / steps), steps, scales


def exact_int4_groups(weight: torch.Tensor, group: int = EXACT_GROUP
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K] in 0..15, scales, mins [K / group, N] float16) with weight == q *
    scale + min exactly in float32 (as GGUF's own de-quantization computes it),
    where every group of `group` inputs is 4-bit steps of a float16 scale up from a
    float16 minimum that is its smallest value, its largest 15 steps up (a Q4_1
    block expanded, as the default model's weights are); else None."""
    groups = _blocks(weight, group, exact_int4_groups)
    if groups is None:
        return None
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    mins, scales = lo.half(), ((hi - lo) / 15).half()
    if not torch.equal(mins.float(), lo):
        return None
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).float()[..., None]
    q = torch.round((groups - lo[..., None]) / safe)
    if not torch.isfinite(q).all() or q.min() < 0 or q.max() > 15 \
            or not torch.equal(q * safe + lo[..., None], groups):
        return None
    return (q.to(torch.uint8).reshape(weight.shape), scales.t().contiguous(),
            mins.t().contiguous())


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] in column order, the last panel zero-padded."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def _group_panels(per_group: torch.Tensor) -> torch.Tensor:
    """[K / group, N] float16 -> [P, K / group, 16], padded columns 0."""
    return _panels(per_group.t().half())


def pack_weight(weight: torch.Tensor, round_to_int8: bool = False,
                bf16_pairs: bool = False) -> Packed:
    """[N, K] float weight -> packed panels, the fewest bytes that hold every value
    (as float32) exactly: int4 where every group of 32 is a Q4_1 block's values (a fifth of the
    bytes), int8 where it is a Q8_0 block's (close to a quarter), else bfloat16 where
    every value is exact in bf16, else float32. round_to_int8: a weight on no Q4_1
    grid is rounded to Q8_0 instead (a Q8_0 block's values come out as they are).
    bf16_pairs: a bf16 model's layer on an AVX512-BF16 CPU, whose bf16 rows are
    multiplied in pairs (bf16_pairs.py): its weight (float32 or bf16) in pair panels
    (where no rounding to int8 is asked for)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"packs 2-D float weights, not {tuple(weight.shape)} {weight.dtype}")
    pairs = pack_bf16_pairs(weight) if bf16_pairs and not round_to_int8 else None
    if pairs is not None:
        return Packed(pairs)
    weight = weight.float()
    int4 = exact_int4_groups(weight)
    if int4 is not None:
        return pack_int4(*int4)
    int8 = round_int8_groups(weight) if round_to_int8 else exact_int8_groups(weight)
    if int8 is not None:
        return pack_int8(*int8)
    if exact_in_bf16(weight):
        return Packed(_panels(weight)[:, :, BF16_ORDER].to(torch.bfloat16).contiguous())
    return Packed(_panels(weight))


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> Packed:
    """q [N, K] int8 with one scale per output column ([N] float) or a float16
    scale per group of inputs ([K / group, N])."""
    if scales.dim() == 1:
        per_column = torch.zeros(-(-q.shape[0] // PANEL) * PANEL)
        per_column[:q.shape[0]] = scales.float()
        return Packed(_panels(q), per_column)
    return Packed(_panels(q), _group_panels(scales))


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> Packed:
    """q [N, K] in 0..15 with a float16 scale and minimum per group of inputs
    ([K / group, N] each): w = q * scale + min. Minimums that are all -8 times their
    scales exactly (a symmetric grid; None says so) are not kept: the kernel derives
    them, the same values, and reads 4.5 bits a weight instead of 5."""
    columns = _panels(q.to(torch.uint8))
    pairs = columns[:, :, :HALF] | (columns[:, :, HALF:] << 4)
    if mins is not None and torch.equal(mins.float(), -8 * scales.float()):
        mins = None
    return Packed(pairs.contiguous(), _group_panels(scales),
                  None if mins is None else _group_panels(mins))


def _columns(packed: Packed) -> torch.Tensor:
    """The panels' values as float32 [P, K, 16] in column order, before scaling."""
    panels = packed.panels
    if panels.dtype == torch.uint8:
        return torch.cat([panels & 15, panels >> 4], dim=2).float()
    if panels.dtype == torch.bfloat16:
        return panels[:, :, torch.argsort(BF16_ORDER)].float()
    return panels.float()


def _per_input(group_panels: torch.Tensor, k: int) -> torch.Tensor:
    """[P, K / group, 16] -> [P, K, 16] float32, each group's value repeated."""
    return group_panels.float().repeat_interleave(k // group_panels.shape[1], dim=1)


def unpack_weight(packed: Packed, n: int) -> torch.Tensor:
    """The float32 [n, K] weight a packed one holds (tests check packing with it)."""
    if is_pairs(packed.panels):
        return pairs_values(packed.panels, n)
    values = _columns(packed)
    k = values.shape[1]
    if packed.scales is not None and packed.scales.dim() == 1:
        values = values * packed.scales.view(-1, 1, PANEL)
    elif packed.scales is not None:
        values = values * _per_input(packed.scales, k)
    if packed.panels.dtype == torch.uint8:  # int4's minimums: stored, or -8 * scale
        mins = packed.mins if packed.mins is not None else packed.scales.float() * -8
        values = values + _per_input(mins, k)
    return values.transpose(1, 2).reshape(len(values) * PANEL, k)[:n]


# Up to this many rows, int4 panels whose groups are whole blocks of DOT_BLOCK inputs
# are multiplied by x quantized to int8 in blocks of DOT_BLOCK where the op is told
# int8_inputs (packed_gemm.cpp: kDotRows, micro_dot); on CPUs with AVX512-VNNI and
# VBMI, int4 and int8 panels at any number of rows (takes_dots, vnni_dots.h).
INT4_DOT_ROWS = 12
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi")
DOT_BLOCK = 32
# Past this many bf16 rows, on a CPU with AVX512-BF16, quantized panels that take no
# integer products are widened into a plain bf16 matrix for oneDNN's bf16 GEMM
# (packed_gemm.cpp: kOneDnnRows).
ONEDNN_ROWS = 64


def vnni_here(flags: set[str] | None = None) -> bool:
    """Whether the op takes VNNI's integer products on this CPU (or one of `flags`)
    ($KVSERVE_NO_VNNI: as on a CPU without them)."""
    flags = cpu_flags() if flags is None else flags
    return not os.environ.get("KVSERVE_NO_VNNI") and all(f in flags for f in VNNI_FLAGS)


def int4_dot_rows(flags: set[str] | None = None) -> int | None:
    """Up to how many rows int4 panels take integer products (None: any), as the op."""
    return None if vnni_here(flags) else INT4_DOT_ROWS


def int8_dot_rows(flags: set[str] | None = None) -> int | None:
    """Likewise for int8 panels: only with VNNI, and then at any number of rows."""
    return None if vnni_here(flags) else 0


def quantized_for_dot(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K] as the int4 kernel's integer products read it, float64: each block
    of DOT_BLOCK inputs on 255 levels, step max|x| / 127, x * (127 / max|x|) rounded
    half to even, in float32 as the kernel computes it."""
    blocks = x.reshape(len(x), -1, DOT_BLOCK)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros(()))
    return (torch.round(blocks * inv).double() * (top / torch.tensor(127.0)).double()
            ).reshape(x.shape)


def takes_dots(packed: Packed, rows: int, k: int) -> bool:
    """Whether packed_linear, told int8_inputs, multiplies `rows` rows of K inputs by
    these panels as integers (x quantized to int8): int4 and int8 panels whose groups
    (int8: or K) are whole blocks of DOT_BLOCK, as many rows as int4_dot_rows /
    int8_dot_rows allow."""
    if k == 0 or packed.panels.dtype not in (torch.uint8, torch.int8):
        return False
    grouped = packed.scales is not None and packed.scales.dim() == 3
    group = k // packed.scales.shape[1] if grouped else k
    limit = int4_dot_rows() if packed.panels.dtype == torch.uint8 else int8_dot_rows()
    return group % DOT_BLOCK == 0 and (limit is None or rows <= limit)


def reference_product(x: torch.Tensor, packed: Packed, n: int,
                      int8_inputs: bool = False) -> torch.Tensor:
    """x W^T in float64 as packed_linear computes it (the tests' and benchmarks'
    oracle): exact products of the weight's values, but with int8_inputs where the op
    takes integer products (takes_dots) the integers' share comes from x quantized
    (quantized_for_dot) and int4's minimums' share (stored or symmetric) from x
    itself."""
    w = unpack_weight(packed, n).double()
    if not int8_inputs or not takes_dots(packed, len(x), x.shape[1]):
        return x.double() @ w.t()
    if packed.panels.dtype != torch.uint8:
        return quantized_for_dot(x) @ w.t()
    mins = unpack_weight(packed._replace(panels=torch.zeros_like(packed.panels)), n).double()
    return quantized_for_dot(x) @ (w - mins).t() + x.double() @ mins.t()


def packed_rows(packed: Packed, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight a packed one holds, [len(ids), K] float32: a tied
    embedding table looked up in its LM head's panels, with no table of its own.
    (Float panels, or int8 ones with group scales: what pack_weight makes.)"""
    panels, scales = packed.panels, packed.scales
    if panels.dtype == torch.uint8 or packed.mins is not None or \
            (scales is not None and scales.dim() == 1):
        raise ValueError("rows are looked up in float or group-scaled int8 panels only")
    lane = ids % PANEL
    if panels.dtype == torch.bfloat16:  # where BF16_ORDER put column `lane`
        lane = lane % HALF * 2 + lane // HALF
    rows = panels.permute(0, 2, 1)[ids // PANEL, lane].float()
    if scales is None:
        return rows
    per_group = scales.permute(0, 2, 1)[ids // PANEL, ids % PANEL].float()
    return rows * per_group.repeat_interleave(rows.shape[-1] // per_group.shape[-1], dim=-1)


def packed_linear(x: torch.Tensor, packed: Packed, n: int, bias: torch.Tensor | None,
                  int8_inputs: bool = False) -> torch.Tensor:
    """x [..., K] float32 times the packed weight, plus bias: [..., n]. int8_inputs:
    int4 panels may take x quantized to int8 (see int4_dot_rows)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # the model's flat tokens
    y = torch.ops.kvserve.packed_linear(rows, packed.panels, n, bias, packed.scales,
                                        packed.mins, int8_inputs)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


class PackedWeight(nn.Module):
    """A layer's packed weight as buffers (moved and traced with the model): the
    product through the op, and rows for a tied embedding. int8_inputs: the layer
    was quantized (a GGUF's blocks, --quantization), so its int4 panels may multiply
    inputs quantized to int8 as llama.cpp does; a float checkpoint's weights keep
    float32 inputs even where they are found on a grid and packed as integers (their
    outputs then stay those of the float model, batch by batch)."""

    def __init__(self, packed: Packed, int8_inputs: bool = False):
        super().__init__()
        for name, tensor in zip(Packed._fields, packed):
            self.register_buffer(name, tensor, persistent=False)
        self.int8_inputs = int8_inputs

    def contents(self) -> Packed:
        return Packed(self.panels, self.scales, self.mins)

    def product(self, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        if is_pairs(self.panels):
            return bf16_linear(x, self.panels, n, bias)
        return packed_linear(x, self.contents(), n, bias, self.int8_inputs)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if is_pairs(self.panels):
            return pairs_rows(self.panels, ids)
        return packed_rows(self.contents(), ids)
