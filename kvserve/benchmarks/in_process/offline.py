"""`kvserve bench offline`: engine throughput with no HTTP. --num-prompts requests of
--input-len random token ids (fixed --seed) and --output-len new tokens each
(ignore_eos, so every request runs to full length) go to Engine.generate at once; the
scheduler batches them as `kvserve serve` would with the same engine options. Timed
after a one-request warm-up (kernels compiled, caches touched)."""
from __future__ import annotations

import random
import time

import torch

from kvserve.benchmarks.in_process.decode import free_device_memory, where_from
from kvserve.benchmarks.in_process.utilisation import Clock
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.weights.loader import resolve_load_format
from kvserve.scheduler.sampling_params import SamplingParams


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab) for _ in range(length)] for _ in range(num)]


def sampling(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                          ignore_eos=True)


def check_args(args) -> None:
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")


def run(args, engine_config: EngineConfig, command: str | None = None) -> dict:
    check_args(args)
    start = time.perf_counter()
    engine = Engine(engine_config)
    clock = Clock(engine.device)
    load_s = clock.now() - start
    vocab = engine.model_config.vocab_size
    need = args.input_len + args.output_len
    if need > engine.max_model_len:
        raise ValueError(f"--input-len + --output-len ({need}) is more than the engine "
                         f"takes ({engine.max_model_len} tokens: the model's context, "
                         "--max-model-len or the KV cache)")
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    params = sampling(args)
    t0 = clock.now()
    engine.generate(prompts[:1], SamplingParams(max_tokens=min(4, args.output_len),
                                                temperature=args.temperature,
                                                ignore_eos=True))  # warm-up
    warmup_s = clock.now() - t0
    steps0 = engine.counters.steps
    t0 = clock.now()
    outputs = engine.generate(prompts, params)
    elapsed = clock.now() - t0
    steps = engine.counters.steps - steps0
    output_tokens = sum(len(o) for o in outputs)
    input_tokens = args.num_prompts * args.input_len
    if output_tokens != args.num_prompts * args.output_len:
        raise RuntimeError(f"{output_tokens} tokens generated, expected "
                           f"{args.num_prompts * args.output_len}")
    c = engine_config
    result = {**where_from(engine.device, command), "torch": torch.__version__,
              "benchmark": "offline throughput, Engine.generate, no HTTP",
              "model": getattr(args, "model_name", None) or str(c.model),
              "load_format": resolve_load_format(c.model, c.load_format),
              "dtype": str(engine.dtype).replace("torch.", ""),
              "device_type": engine.device.type,
              "config": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                         "output_len": args.output_len, "seed": args.seed,
                         "temperature": args.temperature,
                         "max_num_seqs": c.max_num_seqs,
                         "max_num_batched_tokens": c.max_num_batched_tokens,
                         "block_size": c.block_size,
                         "num_kv_blocks": engine.scheduler.stats().num_blocks,
                         "enable_prefix_caching": c.enable_prefix_caching,
                         "attention_backend": engine.runner.attn_backend.name,
                         "cuda_graphs": engine.device.type == "cuda"
                         and not c.enforce_eager},
              "load_s": load_s, "warmup_s": warmup_s, "elapsed_s": elapsed,
              "engine_steps": steps, "num_requests": args.num_prompts,
              "input_tokens": input_tokens, "output_tokens": output_tokens,
              "requests_per_s": args.num_prompts / elapsed,
              "output_tokens_per_s": output_tokens / elapsed,
              "total_tokens_per_s": (input_tokens + output_tokens) / elapsed}
    del engine
    free_device_memory(torch.device(result["device_type"]))
    return result
