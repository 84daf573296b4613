"""GGUF tensor names (llama.cpp's, per family) -> our modules and parameters."""
from __future__ import annotations

from kvserve.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvserve.engine.models.gemma import GemmaForCausalLM
from kvserve.engine.models.gpt_oss import GptOssForCausalLM
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.models.mixtral import MixtralForCausalLM
from kvserve.engine.models.phi3 import Phi3ForCausalLM
from kvserve.engine.models.qwen_moe import QwenMoeForCausalLM
from kvserve.engine.platform.gguf_checkpoint import GGUFCheckpoint
from kvserve.engine.weights.gguf_experts import EXPERT_TENSORS
from kvserve.modelstore.errors import ModelLoadError

GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
# GGUF's per-layer name -> (our module under layers.i, shard of a packed module)
LAYER_NAMES = {
    "attn_norm": ("input_layernorm", None), "ffn_norm": ("post_attention_layernorm", None),
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
    "attn_q_norm": ("self_attn.q_norm", None), "attn_k_norm": ("self_attn.k_norm", None),
    # Mixture-of-experts layers: the router, a shared expert and its gate (Qwen2-MoE);
    # the routed experts' stacked tensors go through gguf_experts.py.
    "ffn_gate_inp": ("mlp.gate", None),
    "ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0),
    "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", None),
    "ffn_gate_inp_shexp": ("mlp.shared_expert_gate", None),
    **{part: (f"mlp.experts.{attr}", None) for part, (attr, _) in EXPERT_TENSORS.items()},
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before its MLP there.
GEMMA_NAMES = {"post_attention_norm": ("post_attention_layernorm", None),
               "ffn_norm": ("pre_feedforward_layernorm", None),
               "post_ffw_norm": ("post_feedforward_layernorm", None)}
# Phi-3 keeps q/k/v as one tensor and gate/up as one (llama.cpp's ffn_up holds both).
PHI3_NAMES = {"attn_qkv": ("self_attn.qkv_proj", None), "ffn_up": ("mlp.gate_up_proj", None)}
# DeepSeek's latent attention (llama.cpp splits kv_b_proj into each head's key part,
# transposed, and value part: MLA's LatentUpProjection puts them back).
DEEPSEEK_NAMES = {"attn_q": ("self_attn.q_proj", None), "attn_q_a": ("self_attn.q_a_proj", None),
                  "attn_q_a_norm": ("self_attn.q_a_layernorm", None),
                  "attn_q_b": ("self_attn.q_b_proj", None),
                  "attn_kv_a_mqa": ("self_attn.kv_a_proj_with_mqa", None),
                  "attn_kv_a_norm": ("self_attn.kv_a_layernorm", None),
                  "attn_k_b": ("self_attn.kv_b_proj", 0), "attn_v_b": ("self_attn.kv_b_proj", 1)}
# The projections a GGUF's blocks may be kept quantized in (those a layer has).
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
               "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj",
               "self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
               "self_attn.kv_a_proj_with_mqa")
# gpt-oss: the MLP's norm is llama.cpp's post_attention_norm, as Hugging Face names it.
GPT_OSS_NAMES = {"post_attention_norm": ("post_attention_layernorm", None)}
# GGUF names (under blk.i, with .weight or .bias) of parameters that are no module's
# weight: gpt-oss's sinks, DeepSeek-V3's routing correction bias.
PARAMETERS = {"attn_sinks": "self_attn.sinks", "exp_probs_b": "mlp.e_score_correction_bias"}
# The model classes whose every tensor has a GGUF name here, and their own names.
CLASS_NAMES = {LlamaForCausalLM: {}, MixtralForCausalLM: {}, QwenMoeForCausalLM: {},
               GemmaForCausalLM: GEMMA_NAMES, Phi3ForCausalLM: PHI3_NAMES,
               GptOssForCausalLM: GPT_OSS_NAMES, DeepseekV2ForCausalLM: DEEPSEEK_NAMES,
               DeepseekV3ForCausalLM: DEEPSEEK_NAMES}



def our_names(ckpt: GGUFCheckpoint, num_layers: int,
               layer_names: dict[str, tuple[str, int | None]]
               ) -> dict[str, tuple[str, int | None]]:
    """GGUF tensor name -> (our module or parameter name, shard)."""
    names: dict[str, tuple[str, int | None]] = {}
    for gguf_name in ckpt.tensors:
        if gguf_name in GLOBAL_NAMES:
            names[gguf_name] = (GLOBAL_NAMES[gguf_name], None)
            continue
        parts = gguf_name.split(".")  # blk.{i}.{name}.weight (or .bias)
        if len(parts) == 4 and parts[2] in PARAMETERS and parts[3] in ("weight", "bias"):
            names[gguf_name] = (f"layers.{parts[1]}.{PARAMETERS[parts[2]]}", None)
            continue
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_names \
                or parts[3] not in ("weight", "bias") or not parts[1].isdigit() \
                or int(parts[1]) >= num_layers:
            if gguf_name.startswith(("rope_freqs", "rope_factors_")):
                continue  # recomputed from the config
            raise ModelLoadError(f"{ckpt.path.name}: unexpected tensor {gguf_name!r}")
        module, shard = layer_names[parts[2]]
        names[gguf_name] = (f"layers.{parts[1]}.{module}.{parts[3]}", shard)
    return names


def sources(names: dict, layer: int, proj: str, kind: str = "weight") -> list[str]:
    """The GGUF tensors of one projection's weight (or bias), in shard order."""
    target = f"layers.{layer}.{proj}.{kind}"
    found = sorted((shard or 0, g) for g, (ours, shard) in names.items() if ours == target)
    return [g for _, g in found]


