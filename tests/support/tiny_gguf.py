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
         "self_attn.k_norm": "attn_k_norm"}
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


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL:
        return GLOBAL[hf_name]
    _, _, layer, *rest = hf_name.split(".")  # model.layers.{i}.{module}.weight (or .bias)
    return f"blk.{layer}.{LAYER['.'.join(rest[:-1])]}.{rest[-1]}"


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
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    _write_tokenizer(writer, model_dir)
    rng = np.random.default_rng(0)
    for hf_name, w in load_file(str(model_dir / "model.safetensors")).items():
        name = gguf_name(hf_name)
        if architecture == "llama" and name.endswith("attn_q.weight"):  # as its converter
            w = permute_rows(w, cfg.num_attention_heads)
        elif architecture == "llama" and name.endswith("attn_k.weight"):
            w = permute_rows(w, cfg.num_key_value_heads)
        kind = gguf.GGMLQuantizationType.F32 if w.ndim == 1 else type_of(name)
        if kind.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL"):
            data = synthetic_blocks(kind.name, *w.shape, rng)
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_dir
