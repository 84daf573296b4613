"""Decode speed of a mixture-of-experts model with its routed experts in bf16, int8
(--quantization int8) and int4 (--quantization int4), same checkpoint, same run, on
CPU (issue 52): batch-1 and 16-sequence decode tokens/s, eager, and the weights'
resident bytes.

    python bench/moe_checkpoint.py /tmp/moe/qwen3moe-2b    # once: 1.98B / 0.39B active
    python bench/moe_quantized_decode.py --model /tmp/moe/qwen3moe-2b [--out FILE.json]"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_tok_s(engine, batch: int, tokens: int) -> float:
    import torch

    from kvserve.scheduler.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 40000, (32,), generator=g).tolist() for _ in range(batch)]
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                  ignore_eos=True))
    # the prompts hit the prefix cache: the time is decode's
    return round(sum(map(len, out)) / (time.perf_counter() - start), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.engine.platform.device import cpu_flags
    from kvserve.engine.weights.quantization import resident_bytes

    result = {"model": args.model, "cpu_flags": simd_flags(cpu_flags()), "runs": {}}
    for quantization in ("none", "int8", "int4"):
        engine = Engine(EngineConfig(model=args.model, dtype="bfloat16", compile="off",
                                     quantization=quantization, max_num_seqs=16))
        row = {"weights_gib": round(resident_bytes(engine.runner.model) / 2**30, 2)}
        for batch in (1, 16):
            row[f"decode_tok_s_batch{batch}"] = decode_tok_s(engine, batch, args.tokens)
        result["runs"][quantization] = row
        print(quantization, row, flush=True)
        del engine
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
