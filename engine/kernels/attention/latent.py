"""Latent attention's call (DeepSeek's MLA, engine/models/mla.py): decodes absorbed,
long prompts expanded, as the DeepSeek-V2 paper and vLLM split them.

Absorbed, every (query, key) pair costs a head 2 x latent + rotary multiply-adds
(scores against the latent and the rotary key, then the latent-weighted sum);
expanded, a head's keys and values are first made from the latents (latent x (nope +
v) a key), then each pair costs nope + rotary + v. A prompt chunk of Q queries is
cheaper expanded once Q x (2 latent + rotary - (nope + rotary + v)) exceeds latent x
(nope + v): about 170 queries at DeepSeek-V3's widths (512 / 64 / 128 / 128), and
2.8x fewer multiply-adds for a fresh 2k-token prompt. The torch reference and the
Triton backend expand such chunks; the others absorb every row."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.kernels.attention.context import get_attention_backend, get_attention_metadata


@torch.library.custom_op("kvserve::latent_attention", mutates_args=("cache",))
def latent_attention(q: torch.Tensor, q_nope: torch.Tensor, entry: torch.Tensor,
                     cache: torch.Tensor, kv_b: torch.Tensor, scale: float,
                     nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, latent + rotary] (W_UK^T q_nope, then the rotated q_rot); q_nope [T, H,
    nope]; entry [T, 1, latent + rotary] the new tokens' cache rows, written at the
    step's slots; cache [blocks, block_size, 1, latent + rotary]; kv_b [H x (nope +
    v), latent] (each head's W_UK rows, then its W_UV rows). Returns (the absorbed
    rows' attention over the latents [T, H, latent + rotary], the expanded rows'
    attention in value space [T, H, v]), each zero on the other's rows: the layer's
    output per head is W_UV (first) + second."""
    backend, meta = get_attention_backend(), get_attention_metadata()
    expand = getattr(backend, "latent_attention", None)
    if expand is not None:
        return expand(q, q_nope, entry, cache, meta, scale, kv_b, nope_dim)
    heads = q.shape[1]
    absorbed = backend.forward(q, entry, entry, cache, cache, meta, scale)
    return absorbed, q.new_zeros(q.shape[0], heads, kv_b.shape[0] // heads - nope_dim)


@latent_attention.register_fake
def _latent_attention_shape(q, q_nope, entry, cache, kv_b, scale, nope_dim):
    heads = q.shape[1]
    return (torch.empty_like(q),
            q.new_empty(q.shape[0], heads, kv_b.shape[0] // heads - nope_dim))


def expands(query_len: int, latent: int, rotary: int, nope: int, v: int) -> bool:
    """Whether a prompt chunk of query_len queries costs fewer multiply-adds expanded."""
    return query_len * (2 * latent + rotary - (nope + rotary + v)) > latent * (nope + v)


# An expanded chunk makes every head's keys and values for its whole context at once;
# past this many bytes in one step the remaining chunks are absorbed instead (exact
# either way), so a long cached prefix cannot claim gigabytes of scratch memory.
EXPANSION_WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True)
class LatentShape:
    """One latent-attention call's widths, read from its tensors."""

    heads: int
    latent: int
    rotary: int
    nope: int
    v: int

    @classmethod
    def of(cls, q: torch.Tensor, kv_b: torch.Tensor, nope: int) -> LatentShape:
        heads, latent = q.shape[1], kv_b.shape[1]
        return cls(heads, latent, q.shape[-1] - latent, nope, kv_b.shape[0] // heads - nope)

    def workspace_bytes(self, context_len: int, itemsize: int) -> int:
        """Scratch of one expanded chunk: the up-projected keys and values, then keys
        [nope, rotary] and values padded to the same width (what the attention
        kernels read)."""
        per_token = self.heads * (self.nope + self.v + 2 * (self.nope + self.rotary))
        return context_len * per_token * itemsize

    def expanded(self, query_lens: list[int], context_lens: list[int],
                 itemsize: int) -> list[bool]:
        """Which of a step's prompt chunks to expand: those past the break-even
        length, in order, while their scratch fits EXPANSION_WORKSPACE_BYTES."""
        chosen, left = [], EXPANSION_WORKSPACE_BYTES
        for query_len, context_len in zip(query_lens, context_lens):
            need = self.workspace_bytes(context_len, itemsize)
            expand = need <= left and expands(query_len, self.latent, self.rotary,
                                              self.nope, self.v)
            left -= need if expand else 0
            chosen.append(expand)
        return chosen
