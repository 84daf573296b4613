"""Phi-3: the Llama-shaped decoder (sliding window on every layer where the config
sets one, longrope scaling), whose checkpoints store q/k/v as one qkv_proj and
gate/up as one gate_up_proj. `checkpoint_tensors` splits them back into the parts
the loader packs (and tensor parallelism slices) as for other families."""
from __future__ import annotations

from kvserve.engine.models.decoder import DecoderModel


class Phi3ForCausalLM(DecoderModel):
    def checkpoint_tensors(self, ckpt_name: str, tensor):
        cfg = self.config
        prefix, _, rest = ckpt_name.partition(".qkv_proj.")
        if rest:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            t = tensor[:]
            for part, (start, size) in zip(("q_proj", "k_proj", "v_proj"),
                                           ((0, q), (q, kv), (q + kv, kv))):
                yield f"{prefix}.{part}.{rest}", t[start:start + size]
            return
        prefix, _, rest = ckpt_name.partition(".gate_up_proj.")
        if rest:
            gate, up = tensor[:].chunk(2, dim=0)
            yield f"{prefix}.gate_proj.{rest}", gate
            yield f"{prefix}.up_proj.{rest}", up
            return
        yield ckpt_name, tensor
