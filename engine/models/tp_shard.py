"""Which part of the model one tensor-parallel rank holds (Megatron's split):
query heads and the MLP's intermediate features split evenly, KV heads split too
(or, with fewer KV heads than ranks, each rank holding the one its query heads
read), the vocabulary split into equal row ranges (the last padded with zero rows).
Column-parallel layers (qkv, gate/up) keep the rank's output rows; row-parallel
ones (o, down) its input columns, their partial sums all-reduced."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.engine.config.model_config import ModelConfig
from kvserve.modelstore.errors import ModelLoadError


@dataclass(frozen=True)
class TPShard:
    rank: int = 0
    size: int = 1

    def check(self, cfg: ModelConfig) -> None:
        """Raises ModelLoadError for a model this many ranks cannot split."""
        n = self.size
        if cfg.num_heads % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} does not divide the model's "
                                 f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ModelLoadError(f"--tensor-parallel-size {n} and the model's "
                                 f"{cfg.num_kv_heads} KV heads: one must divide the other")
        if cfg.intermediate_size % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} does not divide the model's "
                                 f"intermediate size {cfg.intermediate_size}")
        moe = cfg.moe
        if moe is not None and moe.num_experts % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} does not divide the model's "
                                 f"{moe.num_experts} experts (each rank holds a share)")
        if moe is not None and moe.shared_expert_intermediate_size % n:
            raise ModelLoadError(f"--tensor-parallel-size {n} does not divide the shared "
                                 f"expert's size {moe.shared_expert_intermediate_size}")

    def heads(self, cfg: ModelConfig) -> int:
        return cfg.num_heads // self.size

    def kv_heads(self, cfg: ModelConfig) -> int:
        """KV heads held here: a share, or one replicated head (fewer than ranks)."""
        return max(1, cfg.num_kv_heads // self.size)

    def kv_view(self, cfg: ModelConfig) -> ModelConfig:
        """cfg as this rank's KV cache sees it (its KV heads): what a block costs here."""
        return replace(cfg, num_kv_heads=self.kv_heads(cfg))

    def first_kv_head(self, cfg: ModelConfig) -> int:
        # With replication, the KV head that this rank's query heads read.
        return self.rank * cfg.num_kv_heads // self.size

    def intermediate(self, cfg: ModelConfig) -> int:
        return self.split(cfg.intermediate_size)

    def split(self, size: int) -> int:
        """This rank's share of a dimension split evenly (an MLP's features)."""
        return size // self.size

    def experts(self, cfg: ModelConfig) -> int:
        """Routed experts held here (expert parallelism: whole experts per rank)."""
        return cfg.moe.num_experts // self.size

    def vocab(self, cfg: ModelConfig) -> int:
        """Rows of the embedding and the LM head held here (padded to equal shares)."""
        return -(-cfg.vocab_size // self.size)

    def vocab_start(self, cfg: ModelConfig) -> int:
        return self.rank * self.vocab(cfg)

    def checkpoint_slice(self, cfg: ModelConfig, name: str, shard, tensor,
                         module=None) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `tensor` (a safetensors slice,
        read only where indexed; or a tensor), which fills our parameter `name` of
        `module` (shard: the index within a packed layer). Experts are held whole."""
        if self.size == 1:
            return tensor[:]
        if ".qkv_proj." in name:
            heads = (self.heads(cfg), self.kv_heads(cfg), self.kv_heads(cfg))[shard]
            first = (self.rank * heads if shard == 0 else self.first_kv_head(cfg))
            return tensor[first * cfg.head_dim:(first + heads) * cfg.head_dim]
        if ".gate_up_proj." in name:  # this rank's features of gate, then of up
            part = module.shard_sizes[shard]
            return tensor[self.rank * part:(self.rank + 1) * part]
        if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "self_attn.q_proj.weight")):
            part = module.out_features  # latent attention: this rank's heads' rows
            return tensor[self.rank * part:(self.rank + 1) * part]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            part = module.in_features  # this rank's input columns
            return tensor[:, self.rank * part:(self.rank + 1) * part]
        if name.endswith("self_attn.sinks"):  # one per query head
            heads = self.heads(cfg)
            return tensor[self.rank * heads:(self.rank + 1) * heads]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start = self.vocab_start(cfg)
            rows = tensor[start:min(start + self.vocab(cfg), cfg.vocab_size)]
            padded = torch.zeros((self.vocab(cfg), rows.shape[1]), dtype=rows.dtype)
            padded[:len(rows)] = rows
            return padded
        return tensor[:]  # norms, row-parallel biases: every rank holds all of it


SINGLE = TPShard()
