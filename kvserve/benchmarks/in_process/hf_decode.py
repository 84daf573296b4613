"""The workloads of decode.py through transformers' `generate` on the same device and
dtype, for `kvserve bench decode --transformers on` and bench/gpu_decode.py."""
from __future__ import annotations

import statistics

import torch

from kvserve.benchmarks.in_process.measure import (DECODE_PROMPT_LEN, decode_row,
                                                   free_device_memory, make_prompt, peak_memory,
                                                   reset_peak_memory, split_row)
from kvserve.benchmarks.in_process.utilisation import Clock
from kvserve.engine.config.model_config import ModelConfig
from kvserve.modelstore.presets import resolve_model_path


def build_hf(args, device: torch.device, dtype: torch.dtype):
    """The checkpoint, or with --load-format random its shape with random weights
    created on `device` itself (an 8B model initialised on the host first would take
    minutes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(resolve_model_path(args.model))
    if args.load_format == "random":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # run to full length, like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def _step_times(clock: Clock):
    """A stopping criterion that never stops: generate calls it once per new token,
    so it timestamps the first token inside the same call."""
    from transformers import StoppingCriteria

    class StepTimes(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(clock.now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool,
                               device=input_ids.device)

    return StepTimes()


def hf_request(model, clock: Clock, prompt: list[int], new_tokens: int) -> dict:
    from transformers import StoppingCriteriaList

    steps = _step_times(clock)
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


def want_generate_batch(args, device: torch.device) -> bool:
    # On the CPU its manager takes seconds to start even for a tiny model.
    return args.generate_batch == "on" or (args.generate_batch == "auto"
                                           and device.type == "cuda")


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
