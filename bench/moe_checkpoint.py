"""A random-weight Qwen3-MoE checkpoint of a realistic shape for the CPU race against
llama.cpp (issue 52): ~2.0B parameters of which ~0.35B are active a token (24
layers, 64 experts of 384 features, 8 a token, hidden 1024, 16 query / 4 KV heads
of 64), bf16 safetensors as transformers saves them, with the default model's
tokenizer (vocabulary 49,152), so both servers read the same weights and text.

    python bench/moe_checkpoint.py OUT_DIR [--layers 24 --experts 64 ...]

Then llama.cpp's `convert_hf_to_gguf.py OUT_DIR --outtype bf16` (and q8_0) gives
llama-server the same values. Random routing is near uniform: every expert is hit
about equally, which is the costly case for a batch (more experts active a step)."""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def save_with_tokenizer(model, out: Path, tokenizer_dir: Path) -> None:
    """The model's safetensors and config, and the tokenizer's files, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or \
                f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)


def build(out: Path, layers: int, experts: int, top_k: int, hidden: int,
          expert_size: int, seed: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvserve.modelstore.default_model import ensure_default_model

    tokenizer_dir = ensure_default_model()
    cfg = AutoConfig.for_model(
        "qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=49152,
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_size,
        norm_topk_prob=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        initializer_range=0.02)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    save_with_tokenizer(model, out, tokenizer_dir)
    total = sum(p.numel() for p in model.parameters())
    active = total - layers * (experts - top_k) * 3 * hidden * expert_size
    print(f"{out}: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active a token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-size", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build(a.out, a.layers, a.experts, a.top_k, a.hidden, a.expert_size, a.seed)


if __name__ == "__main__":
    main()
