"""Quality of a quantized model against the same weights unquantized (issue 20):
perplexity on a fixed text (bench/data/alice_ch1.txt: the first chapter of Alice's
Adventures in Wonderland, Lewis Carroll, 1865, public domain; ~2.7k tokens of the
default model's tokenizer), computed through the engine's own forward pass from
prompt logprobs, and greedy agreement: of 16 prompts x 64 tokens, the share of
tokens a quantized model generates that the float model generates too, position by
position up to the first difference.

  python bench/quality.py --quantization none int8 int4 gguf --json bench/results/...json
  python bench/quality.py --quantization none int4 int4-awq --group-size 128
  python bench/quality.py --quantization none none+kv-fp8 gguf+kv-fp8

A mode is a --quantization of the default model's float weights, or gguf: its
shipped Q4_1 file served as it is (--load-format gguf); +kv-fp8 adds
--kv-cache-dtype fp8, and @torch or @kvserve its --cpu-kernels.

  python bench/quality.py --quantization none gguf --step-tokens 1"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams

TEXT = Path(__file__).with_name("data") / "alice_ch1.txt"


def text_tokens(engine: Engine, path: Path = TEXT) -> list[int]:
    return engine.tokenizer.encode(path.read_text(encoding="utf-8"))


def perplexity(engine: Engine, tokens: list[int], window: int = 512) -> float:
    """exp of the mean negative logprob of every token after each window's first
    (windows of `window` tokens, no overlap)."""
    windows = [w for w in (tokens[i:i + window] for i in range(0, len(tokens), window))
               if len(w) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    total, count = 0.0, 0
    for at, w in enumerate(windows):
        engine.add_request(f"perplexity-{at}", w, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                for item in (o.prompt_logprobs or [None])[1:]:
                    total -= item.logprob
                    count += 1
    return math.exp(total / count)


def agreement_prompts(engine: Engine, tokens: list[int], count: int = 16) -> list[list[int]]:
    """count prompts of 32 tokens, cut from the text at even steps."""
    step = (len(tokens) - 32) // count
    return [tokens[i * step:i * step + 32] for i in range(count)]


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """The share of tokens that agree, each sequence up to its first difference."""
    same = 0
    for a, b in zip(reference, other):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / sum(len(a) for a in reference)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", nargs="+", default=["none", "int8"])
    ap.add_argument("--model", default=None,
                    help="a float checkpoint's directory (default: the default model's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--group-size", type=int, default=32, help="int4's group")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="tokens (and requests) a step takes: 1 scores the text a token "
                    "a step and generates one request at a time, the rows batch-1 "
                    "decode multiplies (a quantized model's int4 layers, gguf's, then "
                    "take integer products over int8-quantized inputs on AVX2 CPUs: "
                    "engine/kernels/cpu); default: the engine's (512-token prefill "
                    "chunks, 16 requests at once)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kvserve.modelstore.default_model import default_model_dir
    model = args.model or str(default_model_dir())
    results, reference = {}, None
    for mode in args.quantization:
        mode_kv, _, kernels = mode.partition("@")
        weights, _, kv = mode_kv.partition("+")
        gguf = weights == "gguf"
        engine = Engine(EngineConfig(
            model=model, dtype=args.dtype, compile="off",
            quantization_group_size=args.group_size,
            quantization="auto" if gguf else weights,
            load_format="gguf" if gguf else "safetensors",
            kv_cache_dtype="fp8" if kv == "kv-fp8" else "auto", cpu_kernels=kernels or "auto",
            **({"max_num_batched_tokens": args.step_tokens, "max_num_seqs": args.step_tokens}
               if args.step_tokens else {})))
        tokens = text_tokens(engine)
        greedy = engine.generate(agreement_prompts(engine, tokens), SamplingParams(
            max_tokens=64, temperature=0.0, ignore_eos=True))
        reference = reference or greedy
        results[mode] = {"perplexity": perplexity(engine, tokens),
                         "greedy_agreement": greedy_agreement(reference, greedy),
                         "text_tokens": len(tokens)}
        print(mode, results[mode])
    base = results[args.quantization[0]]["perplexity"]
    for mode, r in results.items():
        r["perplexity_vs_first"] = r["perplexity"] / base - 1
    if args.json:
        from kvserve.benchmarks.in_process.decode import where_from
        import torch
        Path(args.json).write_text(json.dumps(
            {**where_from(torch.device("cpu"), "python " + " ".join(sys.argv)),
             "model": model, "dtype": args.dtype, "group_size": args.group_size,
             "step_tokens": args.step_tokens, "results": results},
            indent=1))


if __name__ == "__main__":
    main()
