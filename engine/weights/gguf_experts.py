"""A GGUF's routed experts (blk.i.ffn_{gate,up,down}_exps: [E, N, K] tensors of
blocks, llama.cpp's layout for every mixture-of-experts family) into FusedExperts.

Where all three are of kept types they stay as the file's integers: int8 values (a
codebook type's table entries) with a float32 scale, and minimum where the type has
one, per group of inputs, the K-quants' two float16 factors multiplied (exact in
float32), and 4-bit grids' codes two to a byte. The fused-experts op expands only the
experts a step uses. Any other type is expanded to the model's dtype (logged by the
caller). The experts' resident bytes against the file's, llama.cpp's own files of a
random Qwen3-MoE and gpt-oss: bench/results/gguf_families_2026-11-28.md."""
from __future__ import annotations

import numpy as np
import torch

from kvserve.engine.kernels.group_quant import code_values
from kvserve.engine.models.moe import FusedExperts
from kvserve.engine.models.quantized.group_scales import group_values
from kvserve.engine.platform.gguf_blocks import decode
from kvserve.engine.platform.gguf_checkpoint import KEPT_QUANTIZED, GGUFCheckpoint
from kvserve.modelstore.errors import ModelLoadError

# GGUF tensor -> (our stacked weight, which half of w13: 0 gate, 1 up)
EXPERT_TENSORS = {"ffn_gate_exps": ("w13", 0), "ffn_up_exps": ("w13", 1),
                  "ffn_down_exps": ("w2", 0)}


def expert_names(layer: int, kind: str = "weight") -> dict[str, str]:
    return {part: f"blk.{layer}.{part}.{kind}" for part in EXPERT_TENSORS}


def fill_expert_biases(ckpt: GGUFCheckpoint, experts: FusedExperts, layer: int) -> None:
    """gpt-oss's experts' biases ([E, I] gate and up, [E, H] down) into b13 / b2,
    which must have storage."""
    if experts.b13 is None:
        return
    for part, (attr, which) in EXPERT_TENSORS.items():
        name = f"blk.{layer}.{part}.bias"
        if name not in ckpt.tensors:
            raise ModelLoadError(f"{ckpt.path.name} lacks the experts' {name}")
        _load_stack(ckpt, name, experts, "b13" if attr == "w13" else "b2", which)


def _load_stack(ckpt: GGUFCheckpoint, name: str, experts: FusedExperts, attr: str,
                part: int) -> None:
    """Tensor `name` [E, ...] de-quantized, each expert's slice through
    FusedExperts.load_shard (which checks its shape and places the gate / up half)."""
    values = ckpt.float_tensor(name)
    if len(values) != experts.w13.shape[0]:
        raise ModelLoadError(f"{name} holds {len(values)} experts, expected "
                             f"{experts.w13.shape[0]}")
    try:
        for e, tensor in enumerate(values):
            experts.load_shard(attr, (experts.first + e, part), tensor)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {exc}") from None


def _names(ckpt: GGUFCheckpoint, layer: int) -> dict[str, str]:
    names = expert_names(layer)
    missing = [n for n in names.values() if n not in ckpt.tensors]
    if missing:
        raise ModelLoadError(f"{ckpt.path.name} lacks the experts' {missing}")
    return names


def keep_experts(ckpt: GGUFCheckpoint, experts: FusedExperts, layer: int,
                 device: torch.device) -> str | None:
    """Layer `layer`'s experts kept in their blocks if every one of its three tensors
    is of a kept type: returns their types (e.g. "Q4_K+Q6_K"), else None (nothing
    done: expand_experts, once the float weights have storage)."""
    names = _names(ckpt, layer)
    if any(ckpt.type_name(n) not in KEPT_QUANTIZED for n in names.values()):
        return None
    gate, up, down = (expert_groups(ckpt, names[p]) for p in EXPERT_TENSORS)
    for attr, parts in (("w13", _stack_rows(gate, up)), ("w2", down)):
        experts.keep_groups(attr, *(None if t is None else t.to(device) for t in parts))
    return "+".join(sorted({ckpt.type_name(n) for n in names.values()}))


def expand_experts(ckpt: GGUFCheckpoint, experts: FusedExperts, layer: int) -> None:
    """Layer `layer`'s experts de-quantized by gguf into the float weights."""
    names = _names(ckpt, layer)
    for part, (attr, which) in EXPERT_TENSORS.items():
        _load_stack(ckpt, names[part], experts, attr, which)


def expert_groups(ckpt: GGUFCheckpoint, name: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A [E, N, K] tensor of blocks as int8 values [E, N, K] and float32 scales (and
    minimums) [E, N, G], w = v * scale + min exactly as gguf de-quantizes it."""
    tensor = ckpt.tensors[name]
    data = np.asarray(tensor.data)
    experts, rows = data.shape[0], data.shape[1]
    blocks = decode(ckpt.type_name(name), data.reshape(experts * rows, -1))
    if blocks.codebook is None and blocks.fits_int4():
        blocks = blocks.shifted()  # codes 0..15 (a symmetric grid: a minimum added)
        values = (blocks.q[:, 0::2] | (blocks.q[:, 1::2] << 4)).astype(np.uint8)
    else:
        values = (blocks.q if blocks.codebook is None
                  else blocks.codebook[blocks.q]).astype(np.int8)

    def per_group(fine, base) -> torch.Tensor | None:
        if fine is None:
            return None
        wide = group_values(torch.from_numpy(fine), None if base is None
                            else torch.from_numpy(base), 1)
        return wide.reshape(experts, rows, -1)

    q = torch.from_numpy(values).reshape(experts, rows, -1)
    return (q, per_group(blocks.scales, blocks.scale_base),
            per_group(blocks.mins, blocks.min_base))


def _stack_rows(gate, up) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gate rows then up rows, as w13. Their types may group inputs differently
    (Q4_K by 32, Q6_K by 16): the coarser's scales are repeated to the finer grid
    (the same value for each part of a group, so nothing changes); a half without
    minimums gets zeros; 4-bit codes beside bytes are unpacked to bytes."""
    groups = max(gate[1].shape[-1], up[1].shape[-1])
    if gate[0].dtype != up[0].dtype:
        gate, up = ((code_values(q).to(torch.int8), *rest) for q, *rest in (gate, up))

    def regrid(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(groups // t.shape[-1], dim=-1)

    scales = [regrid(gate[1]), regrid(up[1])]
    mins = [regrid(gate[2]), regrid(up[2])]
    low = None
    if any(m is not None for m in mins):
        low = torch.cat([m if m is not None else torch.zeros_like(s)
                         for m, s in zip(mins, scales)], dim=1)
    return torch.cat([gate[0], up[0]], dim=1), torch.cat(scales, dim=1), low
