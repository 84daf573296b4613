"""Decode speed on the default model: kvserve beside transformers `generate`, same
machine, same run, same weights, greedy with output forced to full length.

  batch 1     one 128-token prompt, 128 new tokens: time to first token and decode tok/s
  16 conc.    16 requests of 128 + 128 at once: aggregate output tok/s
              kvserve: engine offline and through its HTTP server (streaming);
              transformers: one static batch of 16 (left-padded)

Usage: python bench/cpu_vs_transformers.py [--dtypes float32 bfloat16] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.benchmarks.provenance import provenance  # noqa: E402
from kvserve.engine.config.engine_config import EngineConfig  # noqa: E402
from kvserve.engine.core.engine import Engine  # noqa: E402
from kvserve.modelstore.default_model import ensure_default_model  # noqa: E402
from kvserve.scheduler.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN, OUTPUT_LEN, CONCURRENCY = 128, 128, 16


def make_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(count)]


def ours_batch1(engine: Engine, prompt: list[int]) -> dict:
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request("b1", prompt, params)
    engine.step()  # the whole prompt fits the budget: prefill + first token
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_tok_s": (OUTPUT_LEN - 1) / (t2 - t1)}


def ours_concurrent(engine: Engine, prompts: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    assert all(len(o) == OUTPUT_LEN for o in outs)
    return {"output_tok_s": len(prompts) * OUTPUT_LEN / wall, "wall_s": wall}


def ours_http(engine: Engine, prompts: list[list[int]]) -> dict:
    import httpx
    from httpx_sse import EventSource

    from kvserve.engine.client.async_engine import AsyncEngine
    from kvserve.server.entrypoints.app import build_app
    from tests.support.server import running_server

    body = {"max_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(client, url, prompt):
        n = 0
        async with client.stream("POST", url + "/v1/completions",
                                 json={**body, "prompt": prompt}) as r:
            async for event in EventSource(r).aiter_sse():
                n += event.data.startswith("{")
        return n

    async def run(url):
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(one(client, url, p) for p in prompts))

    with running_server(build_app(AsyncEngine(engine), ["m"])) as url:
        t0 = time.perf_counter()
        asyncio.run(run(url))
        wall = time.perf_counter() - t0
    return {"output_tok_s": len(prompts) * OUTPUT_LEN / wall, "wall_s": wall}


def hf_batch1(model, prompt: list[int]) -> dict:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
        t2 = time.perf_counter()
    ttft = t1 - t0
    return {"ttft_s": ttft, "decode_tok_s": (OUTPUT_LEN - 1) / (t2 - t1 - ttft)}


def hf_static_batch(model, prompts: list[list[int]]) -> dict:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=OUTPUT_LEN, pad_token_id=0)
        wall = time.perf_counter() - t0
    assert out.shape[1] == PROMPT_LEN + OUTPUT_LEN
    return {"output_tok_s": len(prompts) * OUTPUT_LEN / wall, "wall_s": wall}


def run_dtype(model_dir: Path, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype,
                                 max_num_batched_tokens=2048, max_num_seqs=64))
    prompts = make_prompts(engine.model_config.vocab_size, CONCURRENCY)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # run to full length, like ignore_eos
    hf_batch1(hf, prompts[0][:16])  # warm-up
    row = {"kvserve_batch1": ours_batch1(engine, prompts[0]),
           "transformers_batch1": hf_batch1(hf, prompts[0]),
           "kvserve_16_offline": ours_concurrent(engine, prompts),
           "kvserve_16_http": ours_http(engine, prompts),
           "transformers_16_static_batch": hf_static_batch(hf, prompts)}
    row["ratio_batch1_decode"] = (row["kvserve_batch1"]["decode_tok_s"]
                                  / row["transformers_batch1"]["decode_tok_s"])
    row["ratio_16_http_vs_hf_batch"] = (row["kvserve_16_http"]["output_tok_s"]
                                        / row["transformers_16_static_batch"]["output_tok_s"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model_dir = ensure_default_model()
    result = {**provenance(), "torch_threads": torch.get_num_threads(),
              "torch": torch.__version__, "model": "SmolLM2-135M-Instruct",
              "workload": f"prompt {PROMPT_LEN}, output {OUTPUT_LEN}, greedy, ignore_eos",
              "results": {}}
    for dtype in args.dtypes:
        result["results"][dtype] = run_dtype(model_dir, dtype)
        print(json.dumps({dtype: result["results"][dtype]}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
