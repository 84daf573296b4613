"""Batch-1 speed at real model sizes, without weights: a shipped preset (engine/presets)
with random weights, kvserve beside transformers in the same run, same dtype, same
device. Greedy, output forced to full length (ignore_eos), timed after a warm-up.

  copy      device-to-device copy of a large buffer: GB/s counting bytes read plus
            written (as .library/device/KINDS.md does), the roofline for the rest
  decode    one 128-token prompt, --decode-tokens new tokens: decode tok/s, and
            model-bandwidth utilisation = (weights + KV read per step) / step time
            / copy bandwidth
  ttft      a --prompt-len (1,024) prompt on an idle engine: time to first token
  split     one --prompt-len + --split-decode-tokens (512) request: prefill vs decode
  transformers  the same workloads through `generate` (and `generate_batch`, its
            continuous batching, where the installed version has it), and ratios

Runs on CPU with the tiny preset as a smoke test (what CI does):
  python bench/gpu_decode.py --preset llama-tiny --json /tmp/r.json
On a GPU: python bench/gpu_decode.py --preset llama-3.1-8b --json r.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import provenance  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import resolve_device, resolve_dtype, weight_bytes  # noqa: E402
from engine.presets import resolve_model_path  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

DECODE_PROMPT_LEN = 128


class Clock:
    """Wall time that waits for the device's queued work at both ends."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def copy_bandwidth(device: torch.device, mib: int, repeats: int) -> dict:
    """Median GB/s of `dst.copy_(src)`, bytes read plus written."""
    n = mib * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()  # never zeros
    dst = torch.empty_like(src)
    clock, inner, times = Clock(device), 10, []
    dst.copy_(src)  # warm-up
    for _ in range(repeats):
        t0 = clock.now()
        for _ in range(inner):
            dst.copy_(src)
        times.append((clock.now() - t0) / inner)
    del src, dst
    t = statistics.median(times)
    return {"buffer_bytes": n * 4, "copy_s": t, "gbps": 2 * n * 4 / t / 1e9}


def bytes_per_decode_step(cfg: ModelConfig, dtype: torch.dtype, context: float) -> dict:
    """Least bytes one batch-1 decode step reads: every weight once, except an untied
    embedding table (one row of it), plus the KV of the whole context."""
    weights = weight_bytes(cfg, dtype)
    if not cfg.tie_word_embeddings:
        weights -= (cfg.vocab_size - 1) * cfg.hidden_size * dtype.itemsize
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return {"weights": weights, "kv": int(kv_per_token * context),
            "total": int(weights + kv_per_token * context)}


def make_prompt(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, vocab) for _ in range(length)]


# -- kvserve -------------------------------------------------------------------------
def build_engine(args, device: torch.device) -> Engine:
    longest = max(args.prompt_len + args.split_decode_tokens,
                  DECODE_PROMPT_LEN + args.decode_tokens)
    block = 16
    # The attention-backend field is new; pass it only when asked, so this script
    # also runs against an engine without it.
    extra = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    return Engine(EngineConfig(
        model=f"preset:{args.preset}", load_format="random", dtype=args.dtype,
        device=str(device), max_model_len=longest + block, block_size=block,
        num_kv_blocks=2 * (longest // block + 2),  # one request at a time, plus slack
        max_num_seqs=4, max_num_batched_tokens=max(2048, args.prompt_len),
        enable_prefix_caching=False, **extra))  # every repeat computes its whole prompt


def run_request(engine: Engine, clock: Clock, prompt: list[int], new_tokens: int) -> dict:
    """One request alone: (first step: prefill + first token, then the decode steps)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = clock.now()
    engine.add_request(f"bench-{time.monotonic_ns()}", prompt, params)
    steps, first = 0, None
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if first is None:
            first = clock.now()
    end = clock.now()
    assert steps == new_tokens, f"{steps} steps for {new_tokens} tokens"
    return {"first_token_s": first - t0, "decode_s": end - first}


def ours_decode(engine: Engine, clock: Clock, args, dtype: torch.dtype) -> dict:
    vocab = engine.model_config.vocab_size
    runs = [run_request(engine, clock, make_prompt(vocab, DECODE_PROMPT_LEN, 100 + i),
                        args.decode_tokens) for i in range(args.repeats)]
    step_s = statistics.median(r["decode_s"] for r in runs) / (args.decode_tokens - 1)
    return decode_row(engine.model_config, dtype, step_s, args.decode_tokens)


def decode_row(cfg: ModelConfig, dtype: torch.dtype, step_s: float, new_tokens: int) -> dict:
    read = bytes_per_decode_step(cfg, dtype, DECODE_PROMPT_LEN + new_tokens / 2)
    return {"tok_s": 1 / step_s, "step_ms": step_s * 1e3,
            "bytes_read_per_step": read["total"],
            "achieved_read_gbps": read["total"] / step_s / 1e9}


def ours_ttft(engine: Engine, clock: Clock, args) -> dict:
    vocab = engine.model_config.vocab_size
    times = [run_request(engine, clock, make_prompt(vocab, args.prompt_len, 200 + i),
                         1)["first_token_s"] for i in range(args.repeats)]
    return {"median_s": statistics.median(times), "all_s": times}


def split_row(first_token_s: float, decode_s: float, new_tokens: int) -> dict:
    total = first_token_s + decode_s
    return {"prefill_s": first_token_s, "decode_s": decode_s, "total_s": total,
            "decode_share": decode_s / total,
            "decode_ms_per_token": decode_s / (new_tokens - 1) * 1e3}


def ours_split(engine: Engine, clock: Clock, args) -> dict:
    prompt = make_prompt(engine.model_config.vocab_size, args.prompt_len, 300)
    r = run_request(engine, clock, prompt, args.split_decode_tokens)
    return split_row(r["first_token_s"], r["decode_s"], args.split_decode_tokens)


def run_ours(args, device: torch.device, dtype: torch.dtype) -> dict:
    clock = Clock(device)
    reset_peak_memory(device)
    t0 = clock.now()
    engine = build_engine(args, device)
    load_s = clock.now() - t0
    load_peak = peak_memory(device)
    vocab = engine.model_config.vocab_size
    run_request(engine, clock, make_prompt(vocab, args.prompt_len, 1), 4)  # warm-up
    row = {"load_s": load_s, "load_peak_bytes": load_peak,
           "attention_backend": getattr(engine.config, "attention_backend", None),
           "decode": ours_decode(engine, clock, args, dtype),
           "ttft": ours_ttft(engine, clock, args), "split": ours_split(engine, clock, args)}
    del engine
    free_device_memory(device)
    return row


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Most bytes allocated on CUDA since the reset: loading weights of N bytes should
    peak near N plus the KV cache, never at a float32 copy (2N for bf16)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- transformers ------------------------------------------------------------------------
def build_hf(args, device: torch.device, dtype: torch.dtype):
    """Random weights in `dtype`, created on `device` itself (an 8B model initialised
    on the host first would take minutes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(str(resolve_model_path(f"preset:{args.preset}")))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # run to full length, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


class _StepTimes(StoppingCriteria):
    """A stopping criterion that never stops: generate calls it once per new token,
    so it timestamps the first token inside the same call."""

    def __init__(self, clock: Clock):
        self.clock, self.times = clock, []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(self.clock.now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_request(model, clock: Clock, prompt: list[int], new_tokens: int) -> dict:
    steps = _StepTimes(clock)
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        t0 = clock.now()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             stopping_criteria=StoppingCriteriaList([steps]))
        end = clock.now()
    assert out.shape[1] == len(prompt) + new_tokens
    first = steps.times[0]
    return {"first_token_s": first - t0, "decode_s": end - first}


def hf_generate_batch(model, clock: Clock, prompt: list[int], new_tokens: int) -> dict:
    """Continuous batching (transformers >= 4.56), one request: output tok/s end to end,
    the second of two calls (the first sets up and warms the manager)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    walls = []
    for _ in range(2):
        t0 = clock.now()
        out = model.generate_batch(inputs=[prompt], generation_config=gen)
        walls.append(clock.now() - t0)
    made = [len(o.generated_tokens) for o in out.values()]
    return {"tok_s": new_tokens / walls[-1], "wall_s": walls[-1], "first_call_s": walls[0],
            "generated_tokens": made}


def hf_workloads(model, clock: Clock, args, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    vocab = cfg.vocab_size
    hf_request(model, clock, make_prompt(vocab, args.prompt_len, 1), 4)  # warm-up
    runs = [hf_request(model, clock, make_prompt(vocab, DECODE_PROMPT_LEN, 100 + i),
                       args.decode_tokens) for i in range(args.repeats)]
    step_s = statistics.median(r["decode_s"] for r in runs) / (args.decode_tokens - 1)
    ttft = [hf_request(model, clock, make_prompt(vocab, args.prompt_len, 200 + i),
                       1)["first_token_s"] for i in range(args.repeats)]
    split = hf_request(model, clock, make_prompt(vocab, args.prompt_len, 300),
                       args.split_decode_tokens)
    return {"decode": decode_row(cfg, dtype, step_s, args.decode_tokens),
            "ttft": {"median_s": statistics.median(ttft), "all_s": ttft},
            "split": split_row(split["first_token_s"], split["decode_s"],
                               args.split_decode_tokens)}


def run_hf(args, device: torch.device, dtype: torch.dtype, cfg: ModelConfig,
           checkpoint) -> dict:
    """`checkpoint(row)` saves the result so far, before generate_batch, which is the
    least proven part (its API moves between transformers versions)."""
    import transformers

    clock = Clock(device)
    reset_peak_memory(device)
    t0 = clock.now()
    model = build_hf(args, device, dtype)
    row = {"version": transformers.__version__, "load_s": clock.now() - t0,
           "load_peak_bytes": peak_memory(device),
           **hf_workloads(model, clock, args, cfg, dtype)}
    checkpoint(row)
    if not want_generate_batch(args, device):
        row["generate_batch"] = {"skipped": f"--generate-batch {args.generate_batch}"}
    elif not hasattr(model, "generate_batch"):
        row["generate_batch"] = {"skipped": "this transformers has no generate_batch"}
    else:
        try:
            prompt = make_prompt(cfg.vocab_size, DECODE_PROMPT_LEN, 100)
            row["generate_batch"] = hf_generate_batch(model, clock, prompt, args.decode_tokens)
        except Exception as exc:  # an API drift must not lose the other numbers
            row["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
    del model
    free_device_memory(device)
    return row


def want_generate_batch(args, device: torch.device) -> bool:
    # On the CPU its manager takes seconds to start even for a tiny model.
    return args.generate_batch == "on" or (args.generate_batch == "auto"
                                           and device.type == "cuda")


# -- report --------------------------------------------------------------------------
def ratios(ours: dict, hf: dict) -> dict:
    """> 1 means kvserve is better (faster decode, shorter TTFT and prefill)."""
    out = {"decode_tok_s": ours["decode"]["tok_s"] / hf["decode"]["tok_s"],
           "ttft": hf["ttft"]["median_s"] / ours["ttft"]["median_s"],
           "split_prefill": hf["split"]["prefill_s"] / ours["split"]["prefill_s"],
           "split_decode": hf["split"]["decode_s"] / ours["split"]["decode_s"]}
    if "tok_s" in hf.get("generate_batch", {}):
        out["decode_tok_s_vs_generate_batch"] = (ours["decode"]["tok_s"]
                                                 / hf["generate_batch"]["tok_s"])
    return out


def add_utilisation(row: dict, copy_gbps: float) -> None:
    row["decode"]["mbu"] = row["decode"]["achieved_read_gbps"] / copy_gbps


def where_from(device: torch.device) -> dict:
    """provenance(), with the device's own name on CUDA. A copy of the tree sent to a
    GPU machine may have no .git (or no git): KVSERVE_COMMIT then names the commit."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    try:
        info = provenance(name)
    except OSError:  # no git executable
        info = {"device": name or "cpu", "commit": "",
                "command": " ".join(["python"] + sys.argv), "python": sys.version.split()[0]}
    info["commit"] = info["commit"] or os.environ.get("KVSERVE_COMMIT", "")
    return info


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--split-decode-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="copy buffer size (default: 2048 on CUDA, 64 on CPU)")
    ap.add_argument("--attention-backend", default=None,
                    help="kvserve's attention backend (default: the engine's own choice)")
    ap.add_argument("--transformers", default="on", choices=["on", "off"])
    ap.add_argument("--generate-batch", default="auto", choices=["auto", "on", "off"],
                    help="time transformers' generate_batch (auto: on CUDA only)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.decode_tokens < 2 or args.split_decode_tokens < 2 or args.repeats < 1:
        ap.error("--decode-tokens and --split-decode-tokens must be >= 2, --repeats >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    cfg = ModelConfig.from_pretrained(f"preset:{args.preset}")
    mib = args.copy_mib or (2048 if device.type == "cuda" else 64)
    result = {**where_from(device), "torch": torch.__version__,
              "preset": args.preset, "dtype": str(dtype).replace("torch.", ""),
              "device_type": device.type, "weight_bytes": weight_bytes(cfg, dtype),
              "workloads": workload_text(args),
              "copy_bandwidth": copy_bandwidth(device, mib, args.repeats)}
    result["kvserve"] = run_ours(args, device, dtype)
    add_utilisation(result["kvserve"], result["copy_bandwidth"]["gbps"])
    save(result, args.json)  # each phase is kept even if a later one hangs or dies
    if args.transformers == "on":
        result["transformers"] = run_hf(args, device, dtype, cfg,
                                        lambda row: save({**result, "transformers": row},
                                                         args.json))
        add_utilisation(result["transformers"], result["copy_bandwidth"]["gbps"])
        result["ratios_kvserve_over_transformers"] = ratios(result["kvserve"],
                                                            result["transformers"])
    print(json.dumps(result, indent=1), flush=True)
    save(result, args.json)
    return result


def save(result: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1) + "\n")


def workload_text(args) -> dict:
    return {"decode": f"prompt {DECODE_PROMPT_LEN}, {args.decode_tokens} new tokens, "
                      f"median of {args.repeats}",
            "ttft": f"prompt {args.prompt_len}, median of {args.repeats}",
            "split": f"prompt {args.prompt_len}, {args.split_decode_tokens} new tokens",
            "sampling": "greedy, ignore_eos, batch 1, after a warm-up"}


if __name__ == "__main__":
    main()
