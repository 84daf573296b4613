"""Mixtral: Mistral's attention and a mixture of experts in every layer. Its
checkpoints name the block block_sparse_moe and each expert's projections w1
(gate), w3 (up), w2 (down)."""
from __future__ import annotations

import re

from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.moe import expert_name

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w3|w2)\.(weight)$")
_PARTS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}


class MixtralForCausalLM(DecoderModel):

    @classmethod
    def checkpoint_name(cls, ckpt_name: str):
        name = ckpt_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        return expert_name(name, _PARTS, _EXPERT) or super().checkpoint_name(name)
