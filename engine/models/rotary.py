"""Rotary position embeddings: the inverse frequencies of every scaling transformers
knows by name (default, linear, llama3, yarn, longrope, dynamic NTK), and a cos/sin
table precomputed per position, so a step gathers its rows and no forward pass
recomputes frequencies.

Scalings that transformers recomputes from the sequence's length as it runs are
tabulated per position instead, so a batch of requests of any lengths shares one
table (vLLM does the same):
- dynamic NTK: row p holds the frequencies transformers uses once the sequence is
  p + 1 long, which is what it uses for a decoded token at p; a prompt longer than
  max_position_embeddings is rotated per position rather than all at its length.
- longrope: rows below original_max_position_embeddings use the short factors, the
  rest the long ones; transformers switches every position to the long factors once
  a sequence outgrows the original context."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.engine.config.rope_config import RopeConfig


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def rope_inv_freq(dim: int, rope: RopeConfig) -> torch.Tensor:
    """The inverse frequencies [dim / 2] of positions inside the pretrained context."""
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn(dim, rope)
    if rope.rope_type == "longrope":
        return longrope_inv_freq(dim, rope, rope.short_factor)
    return inv_freq


def longrope_inv_freq(dim: int, rope: RopeConfig, factors: tuple[float, ...]) -> torch.Tensor:
    rescale = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (rescale * rope.theta ** _exponents(dim))


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (yarn's and longrope's temperature)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
                rope.factor, rope.mscale_all_dim)
        return yarn_mscale(rope.factor)
    if rope.rope_type == "longrope":
        factor = _longrope_factor(rope)
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_factor(rope: RopeConfig) -> float:
    if rope.factor != 1.0:
        return rope.factor
    return rope.max_position_embeddings / rope.original_max_position_embeddings


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1 context extension: long wavelengths are slowed by `factor`, short ones
    # kept, and the band between is interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, rope: RopeConfig) -> torch.Tensor:
    # YaRN: frequencies that turn many times within the original context are kept
    # (extrapolated), slow ones divided by `factor` (interpolated), a linear ramp
    # between the two bands.
    base, old_len = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    extrapolated = 1 - ramp.clamp(0, 1)  # (1 - ramp) twice below: transformers' rounding
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolated) + \
        (1.0 / pos_freqs) * extrapolated


def _dynamic_inv_freq(dim: int, rope: RopeConfig, seq_len: torch.Tensor) -> torch.Tensor:
    """[P, dim / 2]: dynamic NTK's frequencies at each sequence length."""
    max_pos = rope.max_position_embeddings
    seq_len = seq_len.clamp(min=max_pos)  # float32, as transformers computes it
    base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (
        dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim)[None].to(seq_len.device))


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    return int(head_dim * rope.partial_rotary_factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.dim = rotary_dim(head_dim, rope)
        self.max_positions, self.rope = max_positions, rope
        self.materialize(torch.device("cpu"))

    def materialize(self, device: torch.device) -> None:
        """(Re)build the float32 table on `device`; the loader calls this after the
        model's parameters were created without data (every tensor here is made on
        an explicit device: the model is built under a meta-device context)."""
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        rope = self.rope
        if rope.rope_type == "dynamic" and rope.factor > 1.0:
            freqs = positions[:, None] * _dynamic_inv_freq(self.dim, rope, positions + 1)
        else:
            freqs = torch.outer(positions, rope_inv_freq(self.dim, rope).to(device))
        if rope.rope_type == "longrope":
            long = longrope_inv_freq(self.dim, rope, rope.long_factor).to(device)
            beyond = positions >= rope.original_max_position_embeddings
            freqs[beyond] = torch.outer(positions[beyond], long.to(device))
        scale = attention_factor(rope)
        self.cos, self.sin = freqs.cos() * scale, freqs.sin() * scale  # [P, dim/2]

    def table(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin for these positions, [T, 1, dim/2] in `dtype`; gathered once
        per forward pass and shared by every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, D]: the first 2 x cos.shape[-1] dims of each head are
    rotated, the rest (partial rotary) passed through. The table is computed in
    float32 and the product taken in x's dtype, as the reference implementation does."""
    rot = 2 * cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
