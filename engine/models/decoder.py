"""A decoder-only transformer over a flat batch of tokens, the shape every supported
family shares: embedding, layers of (norm, attention, norm, MLP) with residuals,
final norm, LM head. A family (engine/models/registry.py) subclasses DecoderModel for
what differs: its layers (`make_layer`), MLP (`make_mlp`; by default a mixture of
experts where the config's MoE makes a layer sparse, else dense), norm
(`norm_class`), embedding (`embed`), and how its checkpoint names and lays out
tensors (`checkpoint_name`, `checkpoint_tensors`).

There is no padding and no batch dimension: row i of every activation is token i of
the step, whatever request it belongs to. Attention is the only place requests are
told apart, through the global attention metadata and the paged KV cache."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.attention import Attention
from kvserve.engine.models.layers import RMSNorm
from kvserve.engine.models.linear import Linear
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.mlp import MLP
from kvserve.engine.models.pipeline_stage import WHOLE, PipelineStage
from kvserve.engine.models.moe import SparseMoE, expert_name
from kvserve.engine.models.rotary import RotaryEmbedding
from kvserve.engine.models.tp_layers import VocabParallelEmbedding
from kvserve.engine.models.tp_shard import SINGLE, TPShard

# checkpoint name fragment -> (our packed module name fragment, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, layer: int = 0,
                 shard: TPShard = SINGLE, norm: type[nn.Module] = RMSNorm):
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, shard, norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, ropes: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                paged: PagedDecode | None = None, lora: LoRAStep | None = None
                ) -> torch.Tensor:
        rope = ropes[self.self_attn.rope_index]
        x = x + self.self_attn(rope, self.input_layernorm(x), paged, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class DecoderModel(nn.Module):
    norm_class: type[nn.Module] = RMSNorm
    # The pipeline stage this process holds (engine/models/pipeline_stage.py prunes
    # the rest) and the pruned parameters' name prefixes.
    stage: PipelineStage = WHOLE
    absent_prefixes: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: TPShard = SINGLE):
        super().__init__()
        self.config = cfg  # the whole model's, whatever part of it `shard` holds
        self.shard = shard
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        # The sliding layers' own rope table, where the family has one (Gemma 3).
        self.local_rotary = (RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope)
                             if cfg.local_rope is not None else None)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab(cfg), cfg.hidden_size,
                                                   shard.vocab_start(cfg))
        self.layers = nn.ModuleList(self.make_layer(cfg, i, shard)
                                    for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, shard.vocab(cfg), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def make_layer(cls, cfg: ModelConfig, layer: int, shard: TPShard) -> nn.Module:
        return DecoderLayer(cfg, cls.make_mlp(cfg, layer, shard), layer, shard,
                            cls.norm_class)

    @classmethod
    def make_mlp(cls, cfg: ModelConfig, layer: int, shard: TPShard) -> nn.Module:
        """Layer `layer`'s MLP: a mixture of experts where the config makes the layer
        sparse, else dense."""
        if cfg.moe is not None and cfg.moe.is_sparse(layer):
            return SparseMoE(cfg, layer, shard)
        return MLP(cfg, layer, shard)

    def rotaries(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary, self.local_rotary) if r is not None]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def checkpoint_tensors(self, ckpt_name: str, tensor):
        """The checkpoint tensor `ckpt_name` as (name, tensor) pieces in the layout
        checkpoint_name maps (a family whose checkpoints fuse what we split, or the
        other way round, rewrites them here); by default as it is."""
        yield ckpt_name, tensor

    @classmethod
    def checkpoint_name(cls, ckpt_name: str) -> tuple[str, object]:
        """A checkpoint tensor's name -> (our parameter's name, the shard it fills
        within a packed parameter or the stacked experts, or None)."""
        name = ckpt_name.removeprefix("model.")
        expert = expert_name(name)
        if expert is not None:
            return expert
        for frag, (packed, shard) in PACKED_MODULES.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{packed}."), shard
        return name, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                num_layers: int | None = None, paged: PagedDecode | None = None,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (logits are taken only for the
        rows that need them, see compute_logits). num_layers: stop after that many
        layers and normalise there (early-exit drafts: the first layers plus the
        LM head make a draft model with no weights of its own). paged: a decode-only
        step's attention inputs, for attention written as plain ops (compiled decode
        graphs on CPU); without it every layer calls the attention custom op.
        lora: the step's adapters (engine/models/lora_step.py), None when it has none."""
        x = self.embed(input_ids)
        ropes = [r.table(positions, x.dtype) for r in self.rotaries()]
        # (Slicing a ModuleList builds a new one: only when asked.)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            x = layer(ropes, x, paged, lora)
        return self.norm(x)

    def forward_stage(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This pipeline stage's layers: from the token ids on the first stage, else
        from the previous stage's hidden states; normalised on the last."""
        stage = self.stage
        x = self.embed(inputs) if stage.first else inputs
        ropes = [r.table(positions, x.dtype) for r in self.rotaries()]
        for i in range(stage.start, min(stage.end, len(self.layers))):
            x = self.layers[i](ropes, x)
        return self.norm(x) if stage.last else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab] (under tensor parallelism on rank 0; every
        rank calls it, the others get their own columns), soft-capped where the
        family caps them (Gemma 2)."""
        logits = comm.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
