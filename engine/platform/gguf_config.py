"""A GGUF file's Hugging Face config, from its metadata alone (a .gguf served with no
config.json beside it), as llama.cpp's converter writes it and its loader reads it
back: what the metadata leaves out is llama.cpp's own assumption for the family
(every layer of a qwen2moe/qwen3moe file sparse, Gemma 3's one full layer in six,
Gemma's 27B query scaling)."""
from __future__ import annotations

import numpy as np

from kvserve.engine.platform.gguf_checkpoint import GGUFCheckpoint
from kvserve.modelstore.errors import ModelLoadError

# GGUF architecture -> (transformers config class, our architecture name). Qwen2's
# q/k/v biases and Qwen3's QK-norm are tensors of their own in the file.
CONFIGS = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
           "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
           "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"),
           "gpt-oss": ("GptOssConfig", "GptOssForCausalLM")}
# llama.cpp writes Mixtral as a `llama` file with experts (llama.expert_count).
MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")
# ... and DeepSeek-V2 and V3 both as `deepseek2`: V3 routes by sigmoid scores (its
# expert_gating_func, or the correction bias tensors only V3 has).
DEEPSEEK = {"v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
            "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
# llama.cpp renormalises the top-k routing weights for these (its build_moe_ffn's
# norm_w), and every layer is sparse (no decoder_sparse_step or mlp_only_layers key).
NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
# Gemma's 27B models scale queries by hidden / heads, not by the head's width; llama.cpp
# knows them by their layer count.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA3_SLIDING_PATTERN = 6  # five sliding layers, then a full one


def hf_config(ckpt: GGUFCheckpoint):
    import transformers

    if "rope_freqs.weight" in ckpt.tensors:
        raise ModelLoadError(f"{ckpt.path.name} scales RoPE by a rope_freqs tensor "
                             "(Llama 3.1-style); serve it from a directory holding the "
                             "model's config.json and the file (--load-format gguf)")
    hidden = int(ckpt.field(ckpt.key("embedding_length")))
    tokens = ckpt.reader.fields.get("tokenizer.ggml.tokens")
    vocab = ckpt.optional(ckpt.key("vocab_size"), len(tokens.data) if tokens else None)
    head_dim = int(ckpt.optional(ckpt.key("attention.key_length"), ckpt.optional(
        ckpt.key("rope.dimension_count"), hidden // ckpt.num_heads)))
    config_class, architecture = (MIXTRAL if _mixtral(ckpt) else DEEPSEEK[_deepseek(ckpt)]
                                  if ckpt.architecture == "deepseek2"
                                  else CONFIGS[ckpt.architecture])
    fields = dict(
        architectures=[architecture], vocab_size=int(vocab), hidden_size=hidden,
        num_hidden_layers=int(ckpt.field(ckpt.key("block_count"))),
        num_attention_heads=ckpt.num_heads, num_key_value_heads=ckpt.num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=decimal(ckpt.field(ckpt.key("attention.layer_norm_rms_epsilon"))),
        max_position_embeddings=int(ckpt.field(ckpt.key("context_length"))),
        rope_theta=decimal(ckpt.optional(ckpt.key("rope.freq_base"), 10000.0)),
        tie_word_embeddings="output.weight" not in ckpt.tensors,
        bos_token_id=ckpt.optional("tokenizer.ggml.bos_token_id", None),
        eos_token_id=ckpt.optional("tokenizer.ggml.eos_token_id", None))
    fields.update(_feed_forward_fields(ckpt))
    family = FAMILY_FIELDS.get(ckpt.architecture)
    if family is not None:
        fields.update(family(ckpt, fields))
    return getattr(transformers, config_class)(**fields)


def _mixtral(ckpt: GGUFCheckpoint) -> bool:
    return ckpt.architecture == "llama" and ckpt.key("expert_count") in ckpt.reader.fields


def _deepseek(ckpt: GGUFCheckpoint) -> str:
    sigmoid = ckpt.optional(ckpt.key("expert_gating_func"), None) == SIGMOID_GATING
    return "v3" if sigmoid or any(n.endswith("exp_probs_b.bias") for n in ckpt.tensors) else "v2"


def _feed_forward_fields(ckpt: GGUFCheckpoint) -> dict:
    """The MLP's config fields: a dense model's width; a mixture of experts' too where
    the file has one, and its experts' fields."""
    dense = ckpt.optional(ckpt.key("feed_forward_length"), None)
    if _mixtral(ckpt):  # every layer's experts as wide as its feed-forward length
        return dict(intermediate_size=int(ckpt.optional(
            ckpt.key("expert_feed_forward_length"), dense)), sliding_window=None,
            num_local_experts=int(ckpt.field(ckpt.key("expert_count"))),
            num_experts_per_tok=int(ckpt.field(ckpt.key("expert_used_count"))))
    if ckpt.architecture == "gpt-oss":  # (no dense MLP: its experts' width)
        return dict(intermediate_size=int(ckpt.field(ckpt.key("expert_feed_forward_length"))),
                    num_local_experts=int(ckpt.field(ckpt.key("expert_count"))),
                    num_experts_per_tok=int(ckpt.field(ckpt.key("expert_used_count"))))
    if ckpt.architecture == "deepseek2":
        return {}  # (_deepseek_fields)
    if ckpt.architecture not in NORM_TOPK:
        return {"intermediate_size": int(ckpt.field(ckpt.key("feed_forward_length")))}
    fields = {} if dense is None else {"intermediate_size": int(dense)}
    fields.update(num_experts=int(ckpt.field(ckpt.key("expert_count"))),
                  num_experts_per_tok=int(ckpt.field(ckpt.key("expert_used_count"))),
                  moe_intermediate_size=int(ckpt.field(ckpt.key("expert_feed_forward_length"))),
                  norm_topk_prob=NORM_TOPK[ckpt.architecture], decoder_sparse_step=1,
                  mlp_only_layers=[])
    shared = ckpt.optional(ckpt.key("expert_shared_feed_forward_length"), None)
    if shared is not None:
        fields["shared_expert_intermediate_size"] = int(shared)
    return fields


def _gemma_fields(ckpt: GGUFCheckpoint, fields: dict) -> dict:
    """Gemma 2 / 3: the window, soft-caps, query scaling, which layers slide, and
    Gemma 3's two rope bases (and linear scaling of the full layers' where given)."""
    layers = fields["num_hidden_layers"]
    big = layers == GEMMA_27B_LAYERS[ckpt.architecture]
    out = dict(sliding_window=int(ckpt.field(ckpt.key("attention.sliding_window"))),
               query_pre_attn_scalar=(fields["hidden_size"] // fields["num_attention_heads"]
                                      if big else fields["head_dim"]),
               final_logit_softcapping=_float_or_none(
                   ckpt.optional(ckpt.key("final_logit_softcapping"), None)))
    if ckpt.architecture == "gemma2":
        out["attn_logit_softcapping"] = _float_or_none(
            ckpt.optional(ckpt.key("attn_logit_softcapping"), None))
        return out
    pattern = ckpt.optional(ckpt.key("attention.sliding_window_pattern"), None)
    sliding = ([bool(p) for p in pattern] if isinstance(pattern, list) else
               [(i + 1) % int(pattern or GEMMA3_SLIDING_PATTERN) != 0 for i in range(layers)])
    full = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    if ckpt.optional(ckpt.key("rope.scaling.type"), None) == "linear":
        full = {**full, "rope_type": "linear",
                "factor": decimal(ckpt.field(ckpt.key("rope.scaling.factor")))}
    out.update(layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
               rope_parameters={"sliding_attention": {
                   "rope_type": "default",
                   "rope_theta": decimal(ckpt.optional(ckpt.key("rope.freq_base_swa"),
                                                       10000.0))},
                   "full_attention": full})
    return out


def _phi3_fields(ckpt: GGUFCheckpoint, fields: dict) -> dict:
    """Phi-3: heads as wide as hidden / heads (the file's rope.dimension_count is the
    rotated part: Phi-4-mini rotates 3/4 of each), the window (0: none), and longrope
    with its factors from the rope_factors_long / _short tensors."""
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    rotated = int(ckpt.optional(ckpt.key("rope.dimension_count"), head_dim))
    original = ckpt.optional(ckpt.key("rope.scaling.original_context_length"), None)
    out = dict(head_dim=head_dim, partial_rotary_factor=rotated / head_dim,
               sliding_window=int(ckpt.optional(ckpt.key("attention.sliding_window"), 0))
               or None)
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in ckpt.tensors:
        factors = {f"{kind}_factor": [decimal(v) for v in ckpt.float_tensor(
            f"rope_factors_{kind}.weight").tolist()] for kind in ("long", "short")}
        out["rope_parameters"] = {"rope_type": "longrope", "rope_theta": fields.pop("rope_theta"),
                                  "original_max_position_embeddings": int(original),
                                  "partial_rotary_factor": rotated / head_dim, **factors}
    return out


def _gpt_oss_fields(ckpt: GGUFCheckpoint, fields: dict) -> dict:
    """gpt-oss: sliding and full layers alternating (the config's default), its
    window, and YaRN as its config states it (llama.cpp writes the factor, the
    original context and the betas; the corrections are not truncated)."""
    out = dict(sliding_window=int(ckpt.field(ckpt.key("attention.sliding_window"))))
    if ckpt.optional(ckpt.key("rope.scaling.type"), None) == "yarn":
        out["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": fields.pop("rope_theta"),
            "factor": decimal(ckpt.field(ckpt.key("rope.scaling.factor"))),
            "original_max_position_embeddings": int(ckpt.field(
                ckpt.key("rope.scaling.original_context_length"))),
            "beta_fast": decimal(ckpt.optional(ckpt.key("rope.scaling.yarn_beta_fast"), 32.0)),
            "beta_slow": decimal(ckpt.optional(ckpt.key("rope.scaling.yarn_beta_slow"), 1.0)),
            "truncate": False}
    return out


def _deepseek_fields(ckpt: GGUFCheckpoint, fields: dict) -> dict:
    """DeepSeek-V2 / V3: latent attention's shapes (llama.cpp writes it as one
    key/value head of the latent's width, the per-head widths under *_mla keys), the
    experts and their grouped routing, the leading dense layers, and YaRN (llama.cpp
    keeps only 0.1 * mscale_all_dim, as yarn_log_multiplier; V3's configs give mscale
    the same value)."""
    key = ckpt.key
    rope = int(ckpt.field(key("rope.dimension_count")))
    groups = int(ckpt.optional(key("expert_group_count"), 1))
    out = dict(num_key_value_heads=fields["num_attention_heads"], head_dim=rope,
               q_lora_rank=ckpt.optional(key("attention.q_lora_rank"), None),
               kv_lora_rank=int(ckpt.field(key("attention.kv_lora_rank"))),
               qk_rope_head_dim=rope,
               qk_nope_head_dim=int(ckpt.field(key("attention.key_length_mla"))) - rope,
               v_head_dim=int(ckpt.field(key("attention.value_length_mla"))),
               intermediate_size=int(ckpt.field(key("feed_forward_length"))),
               moe_intermediate_size=int(ckpt.field(key("expert_feed_forward_length"))),
               n_routed_experts=int(ckpt.field(key("expert_count"))),
               num_experts_per_tok=int(ckpt.field(key("expert_used_count"))),
               n_shared_experts=int(ckpt.optional(key("expert_shared_count"), 0)),
               first_k_dense_replace=int(ckpt.optional(key("leading_dense_block_count"), 0)),
               routed_scaling_factor=decimal(ckpt.optional(key("expert_weights_scale"), 1.0)),
               norm_topk_prob=bool(ckpt.optional(key("expert_weights_norm"), False)),
               n_group=groups, topk_group=int(ckpt.optional(key("expert_group_used_count"), 1)),
               topk_method="group_limited_greedy" if groups > 1 else "greedy")
    if out["q_lora_rank"] is not None:
        out["q_lora_rank"] = int(out["q_lora_rank"])
    if ckpt.optional(key("rope.scaling.type"), None) == "yarn":
        mscale = decimal(ckpt.optional(key("rope.scaling.yarn_log_multiplier"), 0.0) / 0.1)
        out["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": fields.pop("rope_theta"),
            "factor": decimal(ckpt.field(key("rope.scaling.factor"))),
            "original_max_position_embeddings": int(ckpt.field(
                key("rope.scaling.original_context_length"))),
            "beta_fast": decimal(ckpt.optional(key("rope.scaling.yarn_beta_fast"), 32.0)),
            "beta_slow": decimal(ckpt.optional(key("rope.scaling.yarn_beta_slow"), 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}
    return out


# A family's own fields (they may take the generic rope_theta into rope_parameters).
FAMILY_FIELDS = {"gemma2": _gemma_fields, "gemma3": _gemma_fields, "phi3": _phi3_fields,
                 "gpt-oss": _gpt_oss_fields, "deepseek2": _deepseek_fields}


def _float_or_none(value) -> float | None:
    return None if value is None else decimal(value)


def decimal(value) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not
    9.999999747378752e-06), so the config matches the model's own config.json."""
    return float(str(np.float32(value)))
