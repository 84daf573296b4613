"""Latent attention's Triton kernels on the GPU (issue 52) at DeepSeek-V3's widths
(latent 512, rotary 64, nope 128, v 128; 16 heads, a rank's at 8 ranks, and 128):
- decode (triton/latent_absorbed.py): ms a call at batch 1-64 over 4k-token
  contexts, and the latent cache's bytes read per second against the device's copy
  bandwidth measured in the same run;
- a fresh prompt chunk of 512 and 2,048 tokens absorbed (latent_prefill) and
  expanded per head (triton/latent_expanded.py): ms each, to check on the device the
  break-even engine/kernels/attention/latent.py takes from multiply-add counts.

    python bench/latent_triton_speed.py --json out.json
    python bench/latent_triton_speed.py --small --json out.json   # CPU: the interpreter

Written after each phase, so a run cut short keeps what it measured
(bench/gpu_session.py's latent_kernels stage)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.moe_triton_speed import add_run_args, copy_gbps, on_gpu, timed  # noqa: E402


def step(starts: list[int], lens: list[int], block_size: int, device):
    """The step's common metadata, each request's blocks laid out one after another."""
    from kvserve.engine.kernels.attention.step_metadata import build_host_step

    tables, next_block = [], 0
    for start, n in zip(starts, lens):
        blocks = -(-(start + n) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    _, common, _ = build_host_step(starts, lens, tables, block_size).to_device(device)
    return common, next_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunks", default="512,2048")
    add_run_args(ap)
    args = ap.parse_args()
    import torch

    cuda = on_gpu()
    from kvserve.engine.kernels.attention.latent import LatentShape
    from kvserve.engine.kernels.attention.triton.latent_absorbed import (latent_decode,
                                                                          latent_prefill)
    from kvserve.engine.kernels.attention.triton.latent_expanded import expanded_prefill

    device = torch.device("cuda" if cuda else "cpu")
    latent, rotary, nope, v, block_size = 512, 64, 128, 128, 16
    if args.small:
        latent, rotary, nope, v = 32, 16, 16, 16
        args.heads, args.batches, args.context, args.chunks = "4", "1,2", 64, "40"
        args.repeats = 1
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    width = latent + rotary
    scale = (nope + rotary) ** -0.5
    result = {"widths": dict(latent=latent, rotary=rotary, nope=nope, v=v),
              "dtype": str(dtype).removeprefix("torch."), "context": args.context,
              "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
              "copy_gbps": round(copy_gbps(device, 8 if args.small else 1024, sync), 1),
              "decode": {}, "prefill": {}}

    def save():
        args.json.write_text(json.dumps(result, indent=1) + "\n")

    for heads in map(int, args.heads.split(",")):
        for batch in map(int, args.batches.split(",")):
            common, blocks = step([args.context - 1] * batch, [1] * batch, block_size, device)
            cache = torch.randn(blocks, block_size, 1, width, device=device).to(dtype)
            q = torch.randn(batch, heads, width, device=device).to(dtype)
            out = torch.empty_like(q)
            seconds = timed(lambda: latent_decode(
                q, cache, out, common.seq_lens, common.block_tables, scale, latent,
                args.context), args.repeats, sync)
            read = batch * args.context * width * cache.element_size()
            result["decode"][f"h{heads}_b{batch}"] = {
                "ms": round(seconds * 1000, 4), "gbps": round(read / seconds / 1e9, 1)}
            print("decode", heads, batch, result["decode"][f"h{heads}_b{batch}"], flush=True)
        save()
        for chunk in map(int, args.chunks.split(",")):
            common, blocks = step([0], [chunk], block_size, device)
            cache = torch.randn(blocks, block_size, 1, width, device=device).to(dtype)
            q = torch.randn(chunk, heads, width, device=device).to(dtype)
            q_nope = torch.randn(chunk, heads, nope, device=device).to(dtype)
            kv_b = torch.randn(heads * (nope + v), latent, device=device).to(dtype) * 0.05
            shape = LatentShape(heads, latent, rotary, nope, v)
            absorbed, expanded = torch.empty_like(q), q.new_zeros(chunk, heads, v)
            run = (0, 1, chunk)
            absorbed_s = timed(lambda: latent_prefill(
                q, cache, absorbed, common.query_start_loc, common.seq_lens,
                common.block_tables, scale, latent, *run), args.repeats, sync)
            expanded_s = timed(lambda: expanded_prefill(
                q, q_nope, cache, expanded, common.query_start_loc, common.seq_lens,
                common.block_tables, [run], [0, chunk], [chunk], scale, kv_b),
                args.repeats, sync)
            result["prefill"][f"h{heads}_q{chunk}"] = {
                "absorbed_ms": round(absorbed_s * 1000, 3),
                "expanded_ms": round(expanded_s * 1000, 3),
                "expands": shape.expanded([chunk], [chunk], q.element_size())[0]}
            print("prefill", heads, chunk, result["prefill"][f"h{heads}_q{chunk}"], flush=True)
        save()
    for key, row in result["decode"].items():  # top-level figures: the session's summary
        result[f"decode_{key}_gbps"] = row["gbps"]
    save()


if __name__ == "__main__":
    main()
