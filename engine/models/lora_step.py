"""One step's LoRA inputs, and the product each targeted projection adds.

Every token of the flat batch carries its request's adapter slot (-1: none), and the
model adds x @ A[slot].T @ B[slot].T to each projection an adapter targets. The
projections that read one input (q, k and v; gate and up) are one group, as they are
one packed linear in the model: a group's A are stacked, so one shrink serves them
all, and its B sit on the diagonal of one [projections x slots x rank, outputs]
matrix, so one expand adds to the packed output. Three ways to compute it, the same
numbers up to rounding:
- `mask` set (CPU): dense over the resident slots. One shrink of x against every
  slot's A at once ([T, projections x slots x rank]), the columns of other slots
  zeroed by the step's 0/1 mask, one expand (addmm) into the packed output: two
  plain matmuls of fixed shapes per group, which torch.compile traces like the rest
  of the decoder. The stacks are graph inputs, never frozen constants, so loading an
  adapter needs no rebuild. The work grows with --max-loras x --max-lora-rank,
  whatever adapters the step has.
- `per_token` (CPU, compiled decode steps): each token's product with its own
  slot's A and B, gathered by index, in float32. Inductor fuses the gather into its
  own loops, so nothing is materialized: a quarter of the dense work at four slots,
  and no oneDNN calls on unpacked weights (those took 46-55 us each at batch 16:
  with them a 16-request decode step of the default model went from 28 to 42 ms).
  Eager, the gather would be materialized, so eager steps and mixed steps (long
  prompt chunks, where the dense matmuls are efficient) stay dense.
- `mask` None (CUDA): the BGMV Triton kernels (triton_kernels.py), which read only
  each token's own slot, as a custom op the compiler leaves alone.
A step none of whose requests has an adapter gets no LoRAStep at all: it costs
nothing, the same graphs as with LoRA off."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Projections that read the same input, in the order the model packs their outputs.
# Latent attention (DeepSeek, mla.py) adds the query's low-rank pair and the latent's
# own projection; its direct q_proj (no q_lora_rank) is "qkv" with k and v empty. A
# model's absent projections have no inputs and no outputs (adapter.projection_shapes):
# their stacks are empty.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
          "q_a": ("q_a_proj",), "q_b": ("q_b_proj",), "kv_a": ("kv_a_proj_with_mqa",)}
GROUP_OF = {p: (g, j) for g, ps in GROUPS.items() for j, p in enumerate(ps)}
GROUP_INDEX = {g: i for i, g in enumerate(GROUPS)}


@dataclass
class LoRAStep:
    """Per group (GROUPS' order): shrink, A as [layers, projections, slots, rank, in];
    expand, B transposed on the block diagonal, [layers, projections x slots x rank,
    packed outputs]; zero where a slot's adapter has no such projection or a smaller
    rank. out_sizes: each group's projections' output sizes."""
    shrink: tuple[torch.Tensor, ...]
    expand: tuple[torch.Tensor, ...]
    out_sizes: tuple[tuple[int, ...], ...]
    token_slots: torch.Tensor  # [T] int32, -1: no adapter
    mask: torch.Tensor | None  # [T, slots x rank] 0/1 in the model dtype (dense path)
    per_token: bool = False  # gathered per token (compiled decode graphs on CPU)

    def gathered(self) -> LoRAStep:
        """This step for a compiled decode graph: gathered per token where the
        product is computed by torch ops (the kernels need no such choice)."""
        return self if self.mask is None else replace(self, per_token=True)

    def add(self, group: str, layer: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the group's packed projections of x, [T, out]) plus the LoRA deltas."""
        g = GROUP_INDEX[group]
        a, b = self.shrink[g][layer], self.expand[g][layer]
        if self.mask is None:
            return torch.ops.kvserve.lora_bgmv(y, x, a, b, self.token_slots,
                                               list(self.out_sizes[g]))
        if self.per_token:
            return self._gathered(a, b, self.out_sizes[g], x, y)
        n, slots, rank, fan_in = a.shape
        shrunk = (x @ a.reshape(-1, fan_in).T).view(-1, n, slots * rank)
        shrunk = (shrunk * self.mask[:, None, :]).view(-1, n * slots * rank)
        return torch.addmm(y, shrunk, b)

    def _gathered(self, a: torch.Tensor, b: torch.Tensor, out_sizes: tuple[int, ...],
                  x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n, slots, rank, _ = a.shape
        slot = self.token_slots.clamp(min=0).long()  # rows of slot -1 are zeroed below
        has_adapter = (self.token_slots >= 0).float()[None, :, None]
        shrunk = (a[:, slot].float() * x.float()[None, :, None, :]).sum(-1) * has_adapter
        deltas = [(projection_b(b, j, slots, rank, out_sizes)[slot].float()
                   * shrunk[j][:, :, None]).sum(1) for j in range(n)]
        return y + torch.cat(deltas, dim=-1).to(y.dtype)


def slot_mask(token_slots: torch.Tensor, num_slots: int, rank: int,
              dtype: torch.dtype) -> torch.Tensor:
    """[T, num_slots * rank]: 1 in the columns of each token's slot, 0 elsewhere (a
    token with slot -1 has none)."""
    columns = torch.arange(num_slots, device=token_slots.device).repeat_interleave(rank)
    return (token_slots[:, None] == columns[None, :]).to(dtype)


def projection_b(expand: torch.Tensor, j: int, slots: int, rank: int,
                 out_sizes: tuple[int, ...]) -> torch.Tensor:
    """Projection j's B, [slots, rank, out_j], a view of one layer's block-diagonal
    expand matrix."""
    start = sum(out_sizes[:j])
    rows = expand[j * slots * rank:(j + 1) * slots * rank, start:start + out_sizes[j]]
    return rows.unflatten(0, (slots, rank))


@torch.library.custom_op("kvserve::lora_bgmv", mutates_args=())
def lora_bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              token_slots: torch.Tensor, out_sizes: list[int]) -> torch.Tensor:
    """y + each token's product for its slot, projection by projection, through the
    Triton kernels (a [projections, slots, rank, in]; b block-diagonal)."""
    from kvserve.engine.kernels.lora.triton_kernels import add_lora_triton

    out, start = y.clone(), 0
    slots, rank = a.shape[1], a.shape[2]
    for j, size in enumerate(out_sizes):
        if size:  # (latent attention's q_proj: "qkv" without k and v)
            add_lora_triton(out[:, start:start + size], x, a[j],
                            projection_b(b, j, slots, rank, tuple(out_sizes)), token_slots)
        start += size
    return out


@lora_bgmv.register_fake
def _lora_bgmv_shape(y, x, a, b, token_slots, out_sizes):
    return torch.empty_like(y)
