"""gpt-oss: attention with biases, a learned sink logit per head, and alternating
sliding (128) and full layers; a mixture of experts in every layer whose router
takes the top-k logits and softmaxes over them, and whose experts have biases and a
clamped SwiGLU (engine/kernels/moe/fused_experts.py).

Its checkpoints store the experts fused: gate_up_proj [E, H, 2I] with gate and up
features interleaved (gate at even columns), down_proj [E, I, H], both laid out for
x @ W, with biases beside them; `checkpoint_tensors` turns them into per-expert
projections in nn.Linear's layout, which the loader stacks as for other families."""
from __future__ import annotations

from kvserve.engine.models.decoder import DecoderModel


def _per_expert(prefix: str, kind: str, tensor):
    """One fused tensor of the experts -> (name, tensor) per expert and projection."""
    t = tensor[:]
    for e in range(t.shape[0]):
        name = f"{prefix}.{e}"
        if kind == "gate_up_proj":
            yield f"{name}.gate_proj.weight", t[e][:, 0::2].t()
            yield f"{name}.up_proj.weight", t[e][:, 1::2].t()
        elif kind == "gate_up_proj_bias":
            yield f"{name}.gate_proj.bias", t[e][0::2]
            yield f"{name}.up_proj.bias", t[e][1::2]
        elif kind == "down_proj":
            yield f"{name}.down_proj.weight", t[e].t()
        else:  # down_proj_bias
            yield f"{name}.down_proj.bias", t[e]


class GptOssForCausalLM(DecoderModel):

    def checkpoint_tensors(self, ckpt_name: str, tensor):
        prefix, _, kind = ckpt_name.rpartition(".")
        if prefix.endswith(".mlp.experts") and kind in (
                "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            yield from _per_expert(prefix, kind, tensor)
        else:
            yield ckpt_name, tensor

    @classmethod
    def checkpoint_name(cls, ckpt_name: str):
        return super().checkpoint_name(ckpt_name.replace(".mlp.router.", ".mlp.gate."))
