"""What LoRA serving costs (issue 22): output tok/s of N concurrent requests spread
over K adapters against N requests of the base model, on one engine with
--enable-lora, in one run, alternating; and N base requests on an engine without
LoRA, for what --enable-lora costs a batch with no adapter in it (nothing, by
design: such a step has no LoRA inputs).

The adapters are random PEFT-format directories written here (every projection
targeted, rank --rank), so neither peft nor a download is needed: the same script
runs on the GPU machine (bench/gpu_session.sh). Greedy, ignore_eos, no HTTP.

  python bench/lora_overhead.py --json bench/results/lora_overhead_cpu.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.benchmarks.in_process.decode import where_from
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.lora.adapter import MLP_TARGETS, projection_shapes
from kvserve.modelstore.default_model import default_model_dir
from kvserve.scheduler.sampling_params import SamplingParams


def write_random_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT LoRA directory for `cfg` targeting every projection, random A and B
    (B small: the output stays near the base model's, as a trained adapter's does)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = {m: shape for m, shape in projection_shapes(cfg).items() if shape[1]}  # its own
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "mlp" if module in MLP_TARGETS else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) \
                / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(shapes),
         "bias": "none"}))


def throughput(engine: Engine, prompts: list[list[int]], adapters: list[str | None],
               output_len: int) -> float:
    """Output tok/s of the prompts, all added at once, request i under adapters[i]."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = time.monotonic_ns()
    t0 = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"lora-bench-{tag}-{i}", prompt, params, lora_name=name)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - t0
    if tokens != len(prompts) * output_len:
        raise RuntimeError(f"{tokens} tokens, expected {len(prompts) * output_len}")
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", default="wait", choices=["wait", "off"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = args.model or str(default_model_dir())
    cfg = ModelConfig.from_pretrained(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    names = [f"adapter-{k}" for k in range(args.adapters)]
    common = dict(model=model, load_format=args.load_format, compile=args.compile,
                  max_num_seqs=max(64, args.requests))
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(names):
            write_random_adapter(Path(tmp) / name, cfg, args.rank, seed=k)
        lora = LoRAConfig(True, tuple((n, str(Path(tmp) / n)) for n in names),
                          max_loras=args.adapters, max_rank=args.rank)
        engine = Engine(EngineConfig(**common, lora=lora))
        mixed = [names[i % len(names)] for i in range(args.requests)]
        base_only = [None] * args.requests
        for adapters in (base_only, mixed):  # warm-up: graphs, adapters resident
            throughput(engine, prompts[:2], adapters[:2], 8)
        base, with_lora = [], []
        for _ in range(args.rounds):
            base.append(throughput(engine, prompts, base_only, args.output_len))
            with_lora.append(throughput(engine, prompts, mixed, args.output_len))
        device, dtype = engine.device, engine.dtype
        del engine
    plain = Engine(EngineConfig(**common))
    throughput(plain, prompts[:2], [None, None], 8)
    lora_off = [throughput(plain, prompts, base_only, args.output_len)
                for _ in range(args.rounds)]
    b, m, off = (statistics.median(x) for x in (base, with_lora, lora_off))
    result = {**where_from(device, "python bench/lora_overhead.py"),
              "model": args.model, "dtype": str(dtype).replace("torch.", ""),
              "requests": args.requests,
              "adapters": args.adapters, "rank": args.rank, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "base_tok_s": base, "lora_tok_s": with_lora,
              "lora_off_tok_s": lora_off, "overhead": 1 - m / b,
              "enable_lora_cost": 1 - b / off}
    print(f"{args.requests} requests over {args.adapters} adapters (rank {args.rank}): "
          f"{m:.1f} tok/s; base model on the same engine: {b:.1f} tok/s; overhead "
          f"{100 * (1 - m / b):.1f}% (target <= 25%)")
    print(f"base model on an engine without --enable-lora: {off:.1f} tok/s "
          f"(--enable-lora costs a batch with no adapter {100 * (1 - b / off):.1f}%)")
    print(f"rounds: base {[round(x) for x in base]}, lora {[round(x) for x in with_lora]}, "
          f"lora off {[round(x) for x in lora_off]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
