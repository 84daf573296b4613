"""A tiny model directory's weights written as a GGUF file the way llama.cpp's
converter writes one (query/key rows permuted for its RoPE, each tensor in a chosen
type, quantized by the gguf package), next to the directory's config and tokenizer.
The types the gguf package cannot quantize (the K-quants, IQ4) are written as
synthetic blocks instead: valid random blocks whose weights are of a tiny model's
size, in place of the checkpoint's."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # (Phi-3's)
         "mlp.router": "ffn_gate_inp",  # (gpt-oss's)
         # DeepSeek's latent attention and shared experts (kv_b_proj: _split_kv_b)
         "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
         "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# Each expert's projections, stacked over the experts as llama.cpp's converter does.
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # (Mixtral's)
# Shapes every projection of which the CPU int4 layout can hold (rows in blocks of
# 64, inputs in groups of 32): q 128 + k 64 + v 64 rows, gate/up 256 each.
INT4_SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2)
# Shapes whose every input dimension fills the K-quants' blocks of 256, and a
# vocabulary (past the tokenizer's 400) of whole int4 row blocks.
K_QUANT_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=448)
# Each type's float16 scales: their byte offsets in a block and the largest |q * sub-
# block scale| they multiply, so that synthetic weights stay within +-0.1.
SYNTHETIC = {"Q2_K": ((80, 82), 45), "Q3_K": ((108,), 128), "Q4_K": ((0, 2), 945),
             "Q5_K": ((0, 2), 1953), "Q6_K": ((208,), 4096), "IQ4_XS": ((0,), 4064),
             "Q4_0": ((0,), 8), "Q4_1": ((0, 2), 15), "Q5_0": ((0,), 16), "Q5_1": ((0, 2), 31),
             "Q8_0": ((0,), 128), "IQ4_NL": ((0,), 127)}


def synthetic_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8 of valid `kind` blocks: random bits, float16
    scales of a size that keeps the weights near a tiny model's."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    offsets, largest = SYNTHETIC[kind]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in offsets:
        d = rng.uniform(0.3, 1.0, (rows, cols // block, 1)) * 0.1 / largest
        b[..., at:at + 2] = d.astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


GEMMA_ARCHS = ("gemma2", "gemma3")
# Gemma's four norms a layer (llama.cpp's ffn_norm is the one before the MLP there).
GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, architecture: str = "llama") -> str:
    if hf_name in GLOBAL:
        return GLOBAL[hf_name]
    if hf_name.endswith(".self_attn.sinks"):  # gpt-oss's (llama.cpp adds .weight)
        return f"blk.{hf_name.split('.')[2]}.attn_sinks.weight"
    if hf_name.endswith(".mlp.gate.e_score_correction_bias"):  # DeepSeek-V3's
        return f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"
    _, _, layer, *rest = hf_name.split(".")  # model.layers.{i}.{module}.weight (or .bias)
    names = {**LAYER, **GEMMA_LAYER} if architecture in GEMMA_ARCHS else LAYER
    if architecture == "gpt-oss":
        names = {**LAYER, "post_attention_layernorm": "post_attention_norm"}
    return f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"


def _write_yarn(writer, rope: dict) -> bool:
    """YaRN's keys as llama.cpp writes them, where the config scales so; whether it does."""
    import gguf

    if rope.get("rope_type") != "yarn":
        return False
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    return True


def _write_gpt_oss_metadata(writer, cfg) -> None:
    writer.add_sliding_window(cfg.sliding_window)
    _write_yarn(writer, cfg.rope_parameters)


def _write_deepseek_metadata(writer, cfg) -> None:
    """DeepSeek-V2/V3's keys as llama.cpp's converter writes them: latent attention
    as one key/value head of the latent's width, the heads' own widths as *_mla."""
    import gguf

    writer.add_head_count_kv(1)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    if cfg.model_type == "deepseek_v3":  # its config.json's scoring_func
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if _write_yarn(writer, cfg.rope_parameters):
        writer.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope_parameters["mscale_all_dim"])


def _split_kv_b(hf_name: str, w: np.ndarray, cfg):
    """kv_b_proj [H * (nope + v), L] as llama.cpp's converter splits it: each head's
    key part transposed, [H, L, nope] (attn_k_b), and its value part [H, v, L]."""
    layer = hf_name.split(".")[2]
    heads = w.reshape(cfg.num_attention_heads, -1, w.shape[-1])
    yield f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(
        np.swapaxes(heads[:, :cfg.qk_nope_head_dim], 1, 2))
    yield f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(heads[:, cfg.qk_nope_head_dim:])


def _write_phi3_metadata(writer, cfg, head_dim: int) -> None:
    """Phi-3's keys and its longrope factors as tensors, as llama.cpp writes them."""
    rope = cfg.rope_parameters
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                         or cfg.original_max_position_embeddings)
    writer.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))


def _write_gemma_metadata(writer, cfg) -> None:
    """Gemma 2/3's keys, as llama.cpp's converter writes them."""
    writer.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.model_type == "gemma3_text":
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        full = cfg.rope_parameters["full_attention"]
        if full.get("rope_type") == "linear":
            import gguf

            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute for query and key projections."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_tokenizer(writer, model_dir: Path) -> None:
    """The directory's byte-level BPE tokenizer as GGUF metadata (llama.cpp's gpt2
    tokenizer model), with its chat template."""
    import json

    from gguf import TokenType

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["<|im_start|>"])
    writer.add_eos_token_id(special["<|im_end|>"])
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def write_gguf_dir(model_dir: Path, out_dir: Path, type_of, architecture: str = "llama") -> Path:
    """out_dir: model_dir's config and tokenizer plus model.gguf, which carries the
    tokenizer too. type_of(gguf name) -> a gguf.GGMLQuantizationType for each 2-D
    weight (1-D ones are F32)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)
    cfg = AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(out_dir / "model.gguf"), architecture)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if architecture == "deepseek2":
        _write_deepseek_metadata(writer, cfg)
    else:
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if architecture in GEMMA_ARCHS:
        _write_gemma_metadata(writer, cfg)
    if architecture == "phi3":
        _write_phi3_metadata(writer, cfg, head_dim)
    if architecture == "gpt-oss":
        _write_gpt_oss_metadata(writer, cfg)
    writer.add_vocab_size(cfg.vocab_size)
    experts = (getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
               or getattr(cfg, "n_routed_experts", None))
    if experts:  # Mixtral's and gpt-oss's experts are as wide as their intermediate_size
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None)
                                              or cfg.intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _write_tokenizer(writer, model_dir)
    rng = np.random.default_rng(0)
    for name, w in _gguf_tensors(load_file(str(model_dir / "model.safetensors")), architecture,
                                 cfg):
        if architecture in GEMMA_ARCHS and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp writes Gemma's (1 + w) norms' scales
        if architecture == "llama" and name.endswith("attn_q.weight"):  # as its converter
            w = permute_rows(w, cfg.num_attention_heads)
        elif architecture == "llama" and name.endswith("attn_k.weight"):
            w = permute_rows(w, cfg.num_key_value_heads)
        kind = (gguf.GGMLQuantizationType.F32 if w.ndim == 1 or name.endswith(".bias")
                else type_of(name))
        if kind.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL"):
            rows = int(np.prod(w.shape[:-1]))
            data = synthetic_blocks(kind.name, rows, w.shape[-1], rng).reshape(
                *w.shape[:-1], -1)
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_dir


def _gguf_tensors(tensors: dict[str, np.ndarray], architecture: str, cfg):
    """(GGUF name, array) for every tensor; each layer's experts stacked into one
    [E, N, K] tensor per projection."""
    import re

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf_name, w in tensors.items():
        if hf_name.endswith(".self_attn.kv_b_proj.weight"):
            yield from _split_kv_b(hf_name, w, cfg)
            continue
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's
        if ".mlp.experts." in hf_name and hf_name.split(".")[-1] in (
                "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            yield from _fused_experts(hf_name, w)
            continue
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", hf_name)
        if m is None:
            yield gguf_name(hf_name, architecture), w
        else:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = w
    for (layer, proj), by_id in sorted(experts.items()):
        yield f"blk.{layer}.{EXPERTS[proj]}.weight", np.stack([by_id[e] for e in sorted(by_id)])


def _fused_experts(hf_name: str, w: np.ndarray):
    """gpt-oss's fused experts as llama.cpp's converter splits them: gate_up [E, H, 2I]
    (gate at even columns) -> gate and up [E, I, H]; down [E, I, H] -> [E, H, I];
    their biases likewise."""
    prefix, _, kind = hf_name.rpartition(".")
    layer = prefix.split(".")[2]
    if kind == "gate_up_proj":
        t = np.swapaxes(w, -1, -2)
        yield f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, 0::2])
        yield f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(t[:, 1::2])
    elif kind == "gate_up_proj_bias":
        yield f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(w[:, 0::2])
        yield f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(w[:, 1::2])
    elif kind == "down_proj":
        yield f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(np.swapaxes(w, -1, -2))
    else:
        yield f"blk.{layer}.ffn_down_exps.bias", w
