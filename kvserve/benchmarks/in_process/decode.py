"""`kvserve bench decode`: batch-1 speed of the engine on one device, no HTTP.
Greedy, output forced to full length (ignore_eos), timed after a warm-up.

  copy      device-to-device copy of a large buffer: GB/s counting bytes read plus
            written, the roofline for the rest
  peak      FLOP/s the device can do: a spec-sheet table for known GPUs, else a
            large matmul measured in the run's dtype (utilisation.peak_tflops)
  decode    one 128-token prompt, --decode-tokens new tokens: decode tok/s, and
            model-bandwidth utilisation = (weights + KV read per step) / step time
            / copy bandwidth
  ttft      a --prompt-len (1,024) prompt on an idle engine: time to first token,
            hence prefill tok/s and MFU = prefill FLOPs / that time / peak
  split     one --prompt-len + --split-decode-tokens (512) request: prefill vs decode
  transformers  with --transformers on, the same workloads through `generate` on the
            same device in the same run, and ratios (hf_decode.py)

bench/gpu_decode.py is this with its own flags (--preset NAME) and transformers on.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from kvserve.benchmarks.in_process.measure import (DECODE_PROMPT_LEN, bench_compile, decode_row,
                                                   free_device_memory, make_prompt, peak_memory,
                                                   reset_peak_memory, split_row)
from kvserve.benchmarks.in_process.utilisation import (Clock, copy_bandwidth, mbu, mfu,
                                                       peak_tflops, prefill_flops,
                                                       weights_read_per_step)
from kvserve.benchmarks.provenance import provenance
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.platform.device import resolve_device, resolve_dtype
from kvserve.engine.weights.loader import resolve_load_format
from kvserve.modelstore.presets import PREFIX, is_preset
from kvserve.modelstore.weight_bytes import weight_bytes
from kvserve.scheduler.sampling_params import SamplingParams

BLOCK = 16



def longest_request(args) -> int:
    return max(args.prompt_len + args.split_decode_tokens,
               DECODE_PROMPT_LEN + args.decode_tokens)


# -- kvserve -------------------------------------------------------------------------
def build_engine(args, device: torch.device) -> Engine:
    """One request at a time: a KV cache just big enough, no prefix caching (every
    repeat computes its whole prompt), a whole prompt in one step."""
    longest = longest_request(args)
    return Engine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype,
        device=str(device), max_model_len=longest + BLOCK, block_size=BLOCK,
        num_kv_blocks=2 * (longest // BLOCK + 2),  # one request at a time, plus slack
        max_num_seqs=4, max_num_batched_tokens=max(2048, args.prompt_len),
        enable_prefix_caching=False, seed=args.seed,
        attention_backend=args.attention_backend or "auto",
        enforce_eager=bool(getattr(args, "enforce_eager", False)),
        compile=bench_compile(args) if hasattr(args, "compile") else "off",
        quantization=getattr(args, "quantization", "none"),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        async_scheduling=bool(getattr(args, "async_scheduling", False)),
        cpu_kernels=getattr(args, "cpu_kernels", "auto")))


def run_request(engine: Engine, clock: Clock, prompt: list[int], new_tokens: int) -> dict:
    """One request alone: (first step: prefill + first token, then the decode steps).
    Under async scheduling a step returns the one before it's tokens: the first token
    is out when a step first returns output, and one more step drains the last."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = clock.now()
    engine.add_request(f"bench-{time.monotonic_ns()}", prompt, params)
    steps, first = 0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if first is None and outputs:
            first = clock.now()
    end = clock.now()
    expected = new_tokens + (1 if engine.config.async_scheduling else 0)
    assert steps == expected, f"{steps} steps for {new_tokens} tokens"
    return {"first_token_s": first - t0, "decode_s": end - first}



def ours_decode(engine: Engine, clock: Clock, args, dtype: torch.dtype) -> dict:
    vocab = engine.model_config.vocab_size
    runs = [run_request(engine, clock, make_prompt(vocab, DECODE_PROMPT_LEN, 100 + i),
                        args.decode_tokens) for i in range(args.repeats)]
    step_s = statistics.median(r["decode_s"] for r in runs) / (args.decode_tokens - 1)
    return decode_row(engine.model_config, dtype, step_s, args.decode_tokens,
                      weights_read_per_step(engine.runner.model), engine.kv_format.dtype)


def ours_ttft(engine: Engine, clock: Clock, args) -> dict:
    vocab = engine.model_config.vocab_size
    times = [run_request(engine, clock, make_prompt(vocab, args.prompt_len, 200 + i),
                         1)["first_token_s"] for i in range(args.repeats)]
    return {"median_s": statistics.median(times), "all_s": times}


def ours_split(engine: Engine, clock: Clock, args) -> dict:
    prompt = make_prompt(engine.model_config.vocab_size, args.prompt_len, 300)
    r = run_request(engine, clock, prompt, args.split_decode_tokens)
    return split_row(r["first_token_s"], r["decode_s"], args.split_decode_tokens)


def run_ours(args, device: torch.device, dtype: torch.dtype,
             on_phase=lambda row: None) -> dict:
    """kvserve's row; on_phase(row so far) after each phase (a time limit may cut
    the next: an 8B load and its decode are minutes of a GPU call)."""
    clock = Clock(device)
    reset_peak_memory(device)
    t0 = clock.now()
    engine = build_engine(args, device)
    row = {"load_s": clock.now() - t0, "load_peak_bytes": peak_memory(device),
           "attention_backend": engine.runner.attn_backend.name}
    on_phase(row)
    vocab = engine.model_config.vocab_size
    run_request(engine, clock, make_prompt(vocab, args.prompt_len, 1), 4)  # warm-up
    for phase, measure in (("decode", lambda: ours_decode(engine, clock, args, dtype)),
                           ("ttft", lambda: ours_ttft(engine, clock, args)),
                           ("split", lambda: ours_split(engine, clock, args))):
        row[phase] = measure()
        on_phase(row)
    if getattr(args, "profile_steps", 0):
        from kvserve.benchmarks.in_process.device_profile import profile_decode

        row["profile"] = profile_decode(engine, clock, args.profile_steps)
        on_phase(row)
    del engine
    free_device_memory(device)
    return row



# -- utilisation -----------------------------------------------------------------------
def prefill_row(cfg: ModelConfig, prompt_len: int, seconds: float,
                peak: float) -> dict:
    """Prefill speed from the TTFT of a `prompt_len` prompt (its first step computes
    the prompt and samples one token)."""
    flops = prefill_flops(cfg, prompt_len)
    return {"tokens": prompt_len, "s": seconds, "tok_s": prompt_len / seconds,
            "flops": flops, "achieved_tflops": flops / seconds / 1e12,
            "mfu": mfu(flops, seconds, peak)}


def add_utilisation(row: dict, cfg: ModelConfig, prompt_len: int, copy_gbps: float,
                    peak: float) -> None:
    """decode.mbu and a prefill row, for kvserve's row or transformers'."""
    d = row["decode"]
    d["mbu"] = mbu(d["bytes_read_per_step"], d["step_ms"] / 1e3, copy_gbps)
    row["prefill"] = prefill_row(cfg, prompt_len, row["ttft"]["median_s"], peak)


# -- the whole run ---------------------------------------------------------------------
def where_from(device: torch.device, command: str | None) -> dict:
    """provenance(), with the device's own name on CUDA."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return provenance(name, command)


def workload_text(args) -> dict:
    return {"decode": f"prompt {DECODE_PROMPT_LEN}, {args.decode_tokens} new tokens, "
                      f"median of {args.repeats}",
            "ttft": f"prompt {args.prompt_len}, median of {args.repeats}",
            "split": f"prompt {args.prompt_len}, {args.split_decode_tokens} new tokens",
            "sampling": "greedy, ignore_eos, batch 1, after a warm-up"}


def check_args(args, cfg: ModelConfig) -> None:
    """ValueError for settings that cannot run."""
    if args.decode_tokens < 2 or args.split_decode_tokens < 2 or args.repeats < 1:
        raise ValueError("--decode-tokens and --split-decode-tokens must be >= 2, "
                         "--repeats >= 1")
    if args.prompt_len < 1:
        raise ValueError("--prompt-len must be >= 1")
    longest = longest_request(args)
    if longest > cfg.max_model_len:
        raise ValueError(f"the longest request ({longest} tokens) is longer than the "
                         f"model's context ({cfg.max_model_len}); lower --prompt-len, "
                         "--decode-tokens or --split-decode-tokens")


def run(args, command: str | None = None) -> dict:
    """The benchmark; `args` as bench/in_process/cli.py parses them (`model` a
    directory or preset:NAME). With `args.json` the result so far is saved after each
    phase, so a run killed by a time limit still leaves its earlier numbers."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg = ModelConfig.from_pretrained(args.model)
    check_args(args, cfg)
    torch.manual_seed(0)
    mib = args.copy_mib or (2048 if device.type == "cuda" else 64)
    model = str(args.model)
    result = {**where_from(device, command), "torch": torch.__version__,
              "model": getattr(args, "model_name", None) or model,
              "preset": model[len(PREFIX):] if is_preset(model) else None,
              "load_format": resolve_load_format(args.model, args.load_format),
              "dtype": str(dtype).replace("torch.", ""), "device_type": device.type,
              "weight_bytes": weight_bytes(cfg, dtype.itemsize), "workloads": workload_text(args),
              "copy_bandwidth": copy_bandwidth(device, mib, args.repeats),
              "peak_flops": peak_tflops(device, dtype, args.matmul_size, args.repeats)}
    copy_gbps, peak = result["copy_bandwidth"]["gbps"], result["peak_flops"]["tflops"]
    free_device_memory(device)
    save(result, args.json)  # the device's figures first

    def keep(row: dict) -> None:
        """kvserve's row so far, with its decode MBU as soon as it has a decode."""
        d = row.get("decode")
        if d is not None:
            d["mbu"] = mbu(d["bytes_read_per_step"], d["step_ms"] / 1e3, copy_gbps)
        save({**result, "kvserve": row}, args.json)

    result["kvserve"] = run_ours(args, device, dtype, keep)
    add_utilisation(result["kvserve"], cfg, args.prompt_len, copy_gbps, peak)
    save(result, args.json)  # each phase is kept even if a later one hangs or dies
    if args.transformers == "on":
        from kvserve.benchmarks.in_process.hf_decode import ratios, run_hf

        result["transformers"] = run_hf(args, device, dtype, cfg,
                                        lambda row: save({**result, "transformers": row},
                                                         args.json))
        add_utilisation(result["transformers"], cfg, args.prompt_len, copy_gbps, peak)
        result["ratios_kvserve_over_transformers"] = ratios(result["kvserve"],
                                                            result["transformers"])
    save(result, args.json)
    return result


def save(result: dict, path: Path | str | None) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
