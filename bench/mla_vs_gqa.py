"""Latent attention against grouped-query attention at the same size (issue 52): two
random checkpoints of near-equal parameters, one DeepSeek-V3-style (MLA; every
layer's MLP dense, so only the attention differs in kind) and one Llama-style GQA,
served by kvserve's engine one after the other in one run: KV cache bytes per token
(what the cache holds), decode tokens/s at a long context (where attention's reads
matter) for one sequence and for a batch, and the time of a fresh prompt of that
context (MLA's expanded per head, and absorbed as decodes are, for comparison).

    python bench/mla_vs_gqa.py [--context 1024 --batch 8 --out FILE.json]

Both in bf16 on CPU with the default settings (compiled graphs off: the eager path
both ways, so one compile does not favour one side)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMON = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
              num_attention_heads=16, max_position_embeddings=8192, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.02, vocab_size=49152)
# MLA at DeepSeek-V3's proportions, scaled down: latent 256 + rope key 32 per token
# and layer, against GQA's 4 KV heads of 64 (2 x 256 values).
MLA = dict(architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=16, q_lora_rank=384,
           kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
           n_routed_experts=4, num_experts_per_tok=1, n_shared_experts=1,
           moe_intermediate_size=256, first_k_dense_replace=12, n_group=1, topk_group=1)
GQA = dict(architectures=["LlamaForCausalLM"], num_key_value_heads=4, head_dim=64)


def make(out: Path, model_type: str, fields: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **COMMON, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    from kvserve.modelstore.default_model import ensure_default_model

    default = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((default / name).read_bytes())
    return sum(p.numel() for p in model.parameters())


def measure(model_dir: Path, context: int, batch: int) -> dict:
    import torch

    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", compile="off",
                                 num_kv_blocks=(context + 64) * batch // 16 + 16,
                                 max_num_seqs=batch, max_num_batched_tokens=2048))
    tensors = {id(t): t for pair in engine.runner.kv_caches for t in pair}  # MLA: K is V
    slots = next(iter(tensors.values())).shape[0] * engine.config.block_size
    row = {"kv_bytes_per_token": sum(t.numel() * t.element_size()
                                     for t in tensors.values()) / slots}
    generator = torch.Generator().manual_seed(0)
    for n in (1, batch):
        prompts = [torch.randint(100, 40000, (context,), generator=generator).tolist()
                   for _ in range(n)]
        engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                      ignore_eos=True))
        seconds = time.perf_counter() - start
        # prefix hits make the second prefill one token a sequence: the time is decode's
        row[f"decode_tok_s_batch{n}"] = round(sum(len(o) for o in out) / seconds, 1)
    row["prefill_ms"] = prefill_ms(engine, context, generator)
    if engine.model_config.mla is not None:  # the same prompts absorbed, for comparison
        from kvserve.engine.kernels.attention import torch_backend

        expands, torch_backend.expands = torch_backend.expands, lambda *_: False
        try:
            row["prefill_ms_absorbed"] = prefill_ms(engine, context, generator)
        finally:
            torch_backend.expands = expands
    return row


def prefill_ms(engine, context: int, generator, repeats: int = 3) -> float:
    """The best of `repeats` fresh `context`-token prompts' time to the first token
    (one request; new tokens each time, so no prefix hit)."""
    import torch

    from kvserve.scheduler.sampling_params import SamplingParams

    best = float("inf")
    for _ in range(repeats):
        prompt = torch.randint(100, 40000, (context,), generator=generator).tolist()
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                                 ignore_eos=True))
        best = min(best, time.perf_counter() - start)
    return round(best * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.platform.device import cpu_flags

    result = {"cpu_flags": simd_flags(cpu_flags()), "context": args.context,
              "batch": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_type, fields in (("mla", "deepseek_v3", MLA), ("gqa", "llama", GQA)):
            path = Path(tmp) / name
            params = make(path, model_type, fields)
            result[name] = {"parameters": params, **measure(path, args.context, args.batch)}
    result["kv_bytes_gqa_over_mla"] = round(result["gqa"]["kv_bytes_per_token"]
                                            / result["mla"]["kv_bytes_per_token"], 2)
    for key in ("decode_tok_s_batch1", f"decode_tok_s_batch{args.batch}"):
        result[f"{key}_mla_over_gqa"] = round(result["mla"][key] / result["gqa"][key], 2)
    result["prefill_absorbed_over_expanded"] = round(
        result["mla"]["prefill_ms_absorbed"] / result["mla"]["prefill_ms"], 2)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
