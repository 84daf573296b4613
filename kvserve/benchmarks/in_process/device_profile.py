"""Where a batch-1 decode step's time goes on a GPU: `kvserve bench decode
--profile-steps N` records N steps of one request with torch.profiler after the
timed phases and reports

  wall_ms_per_step     the steps' wall time (profiled, so a little above `decode`)
  device_busy_ms       per step, the union of the device's kernel intervals: the
                       time the GPU did anything
  host_share           1 - busy / wall: the step's time the GPU waited on the host
                       (scheduler, batch preparation, launches, reading the token)
  kernels_per_step     kernel launches per step (CUDA graphs replay them as one launch
                       from the host, but each is still a kernel here)
  top_kernels          the costliest kernels by device time per step

A step far above its bytes' floor with a high host_share wants async scheduling or
fewer host syncs; one with a low host_share wants faster kernels (top_kernels says
which). On CPU there is no device timeline: only the wall time is reported."""
from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kvserve.benchmarks.in_process.measure import make_prompt
from kvserve.scheduler.sampling_params import SamplingParams

TOP = 12
WARM_STEPS = 4  # the prefill and a few decodes before recording


def profile_decode(engine, clock, steps: int, prompt_len: int = 128) -> dict:
    """`steps` decode steps of one greedy request, recorded."""
    cuda = engine.runner.device.type == "cuda"
    prompt = make_prompt(engine.model_config.vocab_size, prompt_len, 400)
    params = SamplingParams(max_tokens=steps + 2 * WARM_STEPS, temperature=0.0,
                            ignore_eos=True)
    engine.add_request(f"profile-{time.monotonic_ns()}", prompt, params)
    for _ in range(WARM_STEPS):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = clock.now()
        for _ in range(steps):
            engine.step()
        wall = clock.now() - t0
    while engine.has_unfinished_requests():
        engine.step()
    row = {"steps": steps, "wall_ms_per_step": wall / steps * 1e3}
    if cuda:
        row.update(kernel_summary(prof.events(), steps, wall))
    return row


def kernel_summary(events, steps: int, wall_s: float) -> dict:
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us = union_length(spans)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        total = by_name.setdefault(e.name, [0.0, 0])
        total[0] += e.time_range.elapsed_us()
        total[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    return {"device_busy_ms": busy_us / steps / 1e3,
            "host_share": max(0.0, 1 - busy_us / 1e6 / wall_s),
            "kernels_per_step": len(kernels) / steps,
            "top_kernels": [{"name": name[:120], "ms_per_step": us / steps / 1e3,
                             "calls_per_step": n / steps} for name, (us, n) in top]}


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by sorted (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total
