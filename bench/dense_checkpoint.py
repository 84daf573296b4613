"""A random-weight checkpoint of Llama-3.2-1B's or Llama-3.2-3B's shape for the CPU
race at realistic sizes (issue 53): their layers, widths, heads, rotary scaling and
tied embeddings, with the default model's tokenizer (vocabulary 49,152 rather than
128,256: 1.07B and 3.0B parameters), bf16 safetensors as transformers saves them.
A decode's speed depends on the shapes and bytes, not on the values.

    python bench/dense_checkpoint.py OUT_DIR --shape 1b

llama-server gets the same values from llama.cpp's `convert_hf_to_gguf.py OUT_DIR
--outtype bf16` (then `llama-quantize` to Q8_0 / Q4_0)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The published configs' shapes (hidden, intermediate, layers, query heads, KV heads,
# head dim); both tie the embeddings and scale rotary positions as Llama 3.1 does.
SHAPES = {"1b": (2048, 8192, 16, 32, 8, 64), "3b": (3072, 8192, 28, 24, 8, 128)}
ROPE_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def build(out: Path, shape: str, seed: int) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.moe_checkpoint import save_with_tokenizer
    from kvserve.modelstore.default_model import ensure_default_model

    hidden, intermediate, layers, heads, kv_heads, head_dim = SHAPES[shape]
    tokenizer_dir = ensure_default_model()
    cfg = AutoConfig.for_model(
        "llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=ROPE_SCALING, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, initializer_range=0.02)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    save_with_tokenizer(model, out, tokenizer_dir)
    total = sum(p.numel() for p in model.parameters())
    print(f"{out}: Llama-3.2-{shape.upper()}'s shape, {total / 1e9:.2f}B parameters")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    build(args.out, args.shape, args.seed)


if __name__ == "__main__":
    main()
