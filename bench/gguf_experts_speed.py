"""Batch-1 decode of a mixture of experts whose GGUF experts are kept in their blocks
(engine/weights/gguf_experts.py) against the same file expanded to bf16, same run:
a random Qwen3-MoE (hidden 1024, 8 layers, 32 experts of 768, top 4) written as a
Q4_K_M-like GGUF by tests/support/tiny_gguf.py, eager and compiled.

    python bench/gguf_experts_speed.py [--tokens 64] [--compile]

The kept experts are read as they are by kvserve::expert_linear (decode steps, and
the compiled one-token graph where the CPU kernels load), expanded per routed expert
past a few rows an expert."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import gguf

    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.engine.platform.device import cpu_flags
    from kvserve.scheduler.sampling_params import SamplingParams
    from tests.support.tiny_gguf import write_gguf_dir
    from tests.support.tiny_models import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="also the compiled forward pass")
    args = ap.parse_args()
    T = gguf.GGMLQuantizationType  # noqa: N806

    def mix(name: str):
        if "ffn_gate_inp" in name:
            return T.F32
        return T.Q6_K if "ffn_down" in name or "attn_v" in name or name == "output.weight" \
            else T.Q4_K

    print("cpu flags:", " ".join(simd_flags(cpu_flags())))
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_model(Path(tmp) / "hf", "qwen3moe", hidden_size=1024,
                             intermediate_size=1024, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                             num_experts=32, num_experts_per_tok=4, decoder_sparse_step=1,
                             num_hidden_layers=8, vocab_size=448)
        model = write_gguf_dir(hf, Path(tmp) / "q4km", mix, "qwen3moe")
        prompt = [[5, 17, 42] * 10]
        cases = [("kept", "auto", "off"), ("expanded bf16", "none", "off")]
        if args.compile:
            cases += [("kept, compiled", "auto", "wait"), ("expanded, compiled", "none", "wait")]
        for label, quantization, compile_mode in cases:
            engine = Engine(EngineConfig(model=str(model), load_format="gguf",
                                         quantization=quantization, dtype="bfloat16",
                                         num_kv_blocks=64, compile=compile_mode))
            engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True))
            t0 = time.perf_counter()
            engine.generate(prompt, SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                   ignore_eos=True))
            print(f"{label}: {args.tokens / (time.perf_counter() - t0):.1f} tok/s")


if __name__ == "__main__":
    main()
