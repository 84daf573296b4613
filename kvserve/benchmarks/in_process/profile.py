"""`kvserve bench profile`: where one decode step's time goes, per dtype, batch size
and forward pass (eager / compiled), against the floor of the bytes it must read.

Each case: `batch` requests with 128-token prompts are prefilled, then --steps decode
steps are timed (wall clock), then the same number is recorded by torch.profiler
and every op's own time (self CPU time) is put in one bucket:

  matmuls        weight GEMMs run as ops (aten mm/addmm/linear, oneDNN, MKL)
  compiled graph the compiled decoder's own code: fused elementwise ops, and at
                 batch 1 its GEMV kernels (those are not ops of their own)
  attn gather    copying each context out of the paged cache (the reference path)
  attn compute   the rest of the attention op: SDPA, or the compiled paged kernel
  elementwise    other ops of the forward pass: norms, RoPE, SiLU, adds, embedding
  dispatch       forward time no op accounts for: Python, Dynamo guards, dispatch
  sampler        sampling the step's tokens
  host           the rest of the step: scheduling, batch preparation, outputs

floor = bytes one step must read (every weight once, as it is held: packed bf16
panels for kvserve's CPU GEMM count 2 bytes a value; plus the KV of the contexts) /
the copy bandwidth measured in the same run.

--kernels N also lists each case's N costliest ops and compiled kernels by their own
time per step (Inductor's kernels named in the profile: its kernel profiling is
switched on for the run, which makes its builds cold)."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile, record_function

from kvserve.benchmarks.in_process.measure import make_prompt
from kvserve.benchmarks.in_process.utilisation import (bytes_per_decode_step, copy_bandwidth,
                                                       weights_read_per_step)
from kvserve.benchmarks.provenance import provenance
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.platform.device import resolve_dtype
from kvserve.scheduler.sampling_params import SamplingParams

PROMPT = 128
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise",
           "mkl::_mkl_linear", "aten::_mkl_linear", "mkldnn::_linear_pointwise.binary",
           "kvserve::packed_linear")
GATHERS = ("aten::index", "aten::index_select", "aten::gather")
BUCKETS = ("matmuls", "compiled graph", "attn gather", "attn compute", "elementwise",
           "dispatch", "sampler", "host")


def run(args, command: str | None = None) -> dict:
    # Inductor's kernels show in the profile by name only when built so (and only
    # this run's: the setting is part of every cache key).
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": bool(args.kernels)}):
        return _run(args, command)


def _run(args, command: str | None) -> dict:
    device = torch.device("cpu")
    copy = copy_bandwidth(device, 256, 3)
    result = {**provenance(None, command), "torch": torch.__version__,
              "model": getattr(args, "model_name", None) or str(args.model),
              "copy_bandwidth": copy, "steps": args.steps, "prompt_len": PROMPT,
              "cases": []}
    for dtype_name in args.dtypes:
        for mode in args.modes:
            engine = _engine(args, dtype_name, mode, max(args.batch_sizes))
            for batch in args.batch_sizes:
                case = profile_case(engine, batch, args.steps, args.kernels)
                dtype = resolve_dtype(dtype_name, device)
                weights = weights_read_per_step(engine.runner.model)
                need = bytes_per_decode_step(engine.model_config, dtype, PROMPT + args.steps,
                                             weights, engine.kv_format.dtype)
                floor_ms = (need["weights"] + batch * need["kv"]) / (copy["gbps"] * 1e9) * 1e3
                result["cases"].append({"dtype": dtype_name, "forward": mode, "batch": batch,
                                        "floor_ms": floor_ms, **case})
            del engine
    return result


def _engine(args, dtype: str, mode: str, max_batch: int) -> Engine:
    return Engine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=dtype, device="cpu",
        max_model_len=PROMPT + 2 * args.steps + 64, max_num_seqs=max_batch,
        max_num_batched_tokens=max(512, PROMPT * max_batch), kv_cache_memory=1 << 30,
        enable_prefix_caching=False, compile="wait" if mode == "compiled" else "off",
        attention_backend=args.attention_backend or "auto",
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        cpu_kernels=args.cpu_kernels))


def profile_case(engine: Engine, batch: int, steps: int, kernels: int = 0) -> dict:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=3 * steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", make_prompt(vocab, PROMPT, i), params)
    while len(engine.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill (and a first decode or so)
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    with _labelled(engine), profile(activities=[ProfilerActivity.CPU],
                                    record_shapes=kernels > 0) as prof:
        for _ in range(steps):
            engine.step()
    for i in range(batch):
        engine.abort_request(f"p{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    step_ms = statistics.median(times) * 1e3
    split = {k: v / steps for k, v in _buckets(prof.events()).items()}
    case = {"step_ms": step_ms, "tok_s": batch / step_ms * 1e3, "split_ms": split}
    if kernels:
        # By input shape too: each GEMM's weight shape tells which projection it is.
        top = sorted((e for e in prof.key_averages(group_by_input_shape=True)
                      if not e.key.startswith("kv::")),
                     key=lambda e: e.self_cpu_time_total, reverse=True)[:kernels]
        case["kernels"] = [{"name": e.key, "input_shapes": str(e.input_shapes or ""),
                            "calls_per_step": e.count / steps,
                            "ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in top]
    return case


@contextlib.contextmanager
def _labelled(engine: Engine):
    """Marks the forward pass, the sampler and the whole step in the profile."""
    runner, sampler = engine.runner, engine.runner.sampler
    originals = [(runner, "forward_logits"), (sampler, "launch"), (sampler, "finish"),
                 (engine, "step")]
    saved = [getattr(obj, name) for obj, name in originals]
    labels = ["kv::forward", "kv::sampler", "kv::sampler", "kv::step"]
    for (obj, name), fn, label in zip(originals, saved, labels):
        setattr(obj, name, _label(fn, label))
    try:
        yield
    finally:
        for (obj, name), fn in zip(originals, saved):
            setattr(obj, name, fn)


def _label(fn, label: str):
    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapped


def _buckets(events) -> dict[str, float]:
    """Milliseconds per bucket over all recorded steps."""
    out = dict.fromkeys(BUCKETS, 0.0)
    totals = {"kv::step": 0.0, "kv::forward": 0.0, "kv::sampler": 0.0}
    forward_self = 0.0
    for ev in events:
        ms = ev.self_cpu_time_total / 1e3
        if ev.name in totals:
            totals[ev.name] += ev.cpu_time_total / 1e3
            continue
        chain = _ancestors(ev)
        if "kv::forward" not in chain or "kv::sampler" in chain:
            continue
        forward_self += ms
        if "kvserve::paged_attention" in chain or ev.name == "kvserve::paged_attention":
            out["attn gather" if ev.name in GATHERS else "attn compute"] += ms
        elif ev.name in MATMULS:
            out["matmuls"] += ms
        elif ("CompiledFxGraph" in ev.name or "Compiled Region" in ev.name
              or any("CompiledFxGraph" in name for name in chain)):  # --kernels' kernels
            out["compiled graph"] += ms
        else:
            out["elementwise"] += ms
    out["dispatch"] = max(0.0, totals["kv::forward"] - forward_self)
    out["sampler"] = totals["kv::sampler"]
    out["host"] = max(0.0, totals["kv::step"] - totals["kv::forward"] - totals["kv::sampler"])
    return out


def _ancestors(ev) -> set[str]:
    names, parent = set(), ev.cpu_parent
    while parent is not None:
        names.add(parent.name)
        parent = parent.cpu_parent
    return names


def table(result: dict) -> str:
    head = ["dtype", "forward", "batch", "step ms", "tok/s", "floor ms", *BUCKETS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in result["cases"]:
        row = [c["dtype"], c["forward"], str(c["batch"]), f"{c['step_ms']:.1f}",
               f"{c['tok_s']:.1f}", f"{c['floor_ms']:.1f}",
               *(f"{c['split_ms'][b]:.1f}" for b in BUCKETS)]
        lines.append("| " + " | ".join(row) + " |")
    gbps = result["copy_bandwidth"]["gbps"]
    lines.append(f"\ncopy bandwidth {gbps:.1f} GB/s (read + written)")
    for c in result["cases"]:
        if c.get("kernels"):
            lines.append(f"\n{c['dtype']} {c['forward']} batch {c['batch']}, costliest "
                         "ops and kernels (own time):")
            lines += [f"- {k['ms_per_step']:.2f} ms/step, {k['calls_per_step']:g} calls: "
                      f"{k['name'][:90]} {k['input_shapes'][:80]}".rstrip()
                      for k in c["kernels"]]
    return "\n".join(lines) + "\n"
