"""The padded static-shape decode path that CUDA graphs replay, run without capture
on CPU: bucket choice, padding that writes nowhere, and tokens identical to the
eager path (greedy and seeded, batches that need padding, one-token prompts).

The engines are pinned to the CPU where a test means it (on a GPU machine the
default device is CUDA, where graphs would be captured already); the dtype is
float32 wherever it is left at auto (tests/conftest.py). The Triton planning test
runs on the kernels' device: interpreted here, on the GPU there."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.engine.runner.cuda_graphs import DecodeGraphPlan, batch_buckets
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.attention.paged_batch import DEVICE, needs_kernel_device
from tests.support.reference import varied_prompts


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def _run(engine, prompts, params):
    return engine.generate(prompts, params)


# gemma3: a hybrid model's sliding layer groups have static tables of their own
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_padded_decode_matches_eager(tiny_engine_factory, arch):
    eager = tiny_engine_factory(arch, max_num_seqs=16, device="cpu")
    padded = tiny_engine_factory(arch, max_num_seqs=16, device="cpu")
    padded.runner.use_decode_graphs(DecodeGraphPlan(16, padded.max_model_len, capture=False))
    calls = []
    run = padded.runner.decode_graphs.run
    padded.runner.decode_graphs.run = lambda host, ids, lora: (calls.append(len(ids))
                                                            or run(host, ids, lora))
    prompts = varied_prompts(eager.model_config.vocab_size, count=11)
    prompts.append([7])  # a one-token prompt: its first step is a decode-shaped step
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert _run(padded, prompts, greedy) == _run(eager, prompts, greedy)
    seeded = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i,
                             ignore_eos=True, logprobs=2) for i in range(5)]
    assert _run(padded, prompts[:5], seeded) == _run(eager, prompts[:5], seeded)
    assert calls and any(n not in (1, 2, 4, 8, 16) for n in calls)  # padding happened
    assert padded.scheduler.kv.num_free_blocks == padded.scheduler.kv.num_blocks


def test_padding_rows_write_nothing(tiny_engine_factory):
    engine = tiny_engine_factory("llama", max_num_seqs=8, device="cpu")
    engine.runner.use_decode_graphs(DecodeGraphPlan(8, engine.max_model_len, capture=False))
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    prompts = varied_prompts(engine.model_config.vocab_size, count=3, lengths=(5, 9, 20))
    engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    # only the 4 blocks the requests used (9, 13 and 24 tokens) changed: the padded
    # rows of the 4-bucket wrote nowhere
    changed = {int(b) for k0, (k1, _) in zip(before, engine.runner.kv_caches)
               for b in (k0 != k1).flatten(1).any(1).nonzero().flatten()}
    assert len(changed) == 4


def test_graph_steps_upload_host_values_through_pinned_memory(tiny_engine_factory,
                                                              monkeypatch):
    """Each graph step's host metadata goes to the device through `upload` (pinned,
    one non-blocking transfer per dtype on CUDA), never by a copy from pageable
    memory into a static buffer, which would wait for the step before to finish."""
    import kvserve.engine.runner.cuda_graphs as cuda_graphs

    engine = tiny_engine_factory("llama", max_num_seqs=4, device="cpu")
    engine.runner.use_decode_graphs(DecodeGraphPlan(4, engine.max_model_len, capture=False))
    loads, real = [], cuda_graphs.upload

    def spy(tensors, device):
        loads.append([t.dtype for t in tensors])
        return real(tensors, device)

    monkeypatch.setattr(cuda_graphs, "upload", spy)
    steps = []
    run = engine.runner.decode_graphs.run
    engine.runner.decode_graphs.run = lambda *a: steps.append(1) or run(*a)
    prompts = varied_prompts(engine.model_config.vocab_size, count=3, lengths=(5, 9, 20))
    engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert steps and len(loads) == len(steps)
    assert all(d == [torch.long, torch.long, torch.int32, torch.int32] for d in loads)


def test_capture_needs_cuda(tiny_engine_factory):
    engine = tiny_engine_factory("llama", device="cpu")
    with pytest.raises(ValueError, match="CUDA graphs need CUDA"):
        engine.runner.use_decode_graphs(DecodeGraphPlan(8, engine.max_model_len, capture=True))


@needs_kernel_device
def test_triton_planning_for_a_captured_graph(tiny_engine_factory):
    """Inside a capture there are no host lengths: the Triton backend plans its
    decode splits for max_model_len. Run exactly that body (interpreted on CPU) and
    check the tokens against the eager torch path."""
    eager = tiny_engine_factory("llama", max_num_seqs=4, device=DEVICE, enforce_eager=True)
    graphed = tiny_engine_factory("llama", max_num_seqs=4, attention_backend="triton",
                                  device=DEVICE, enforce_eager=True)
    graphed.runner.use_decode_graphs(DecodeGraphPlan(4, graphed.max_model_len, capture=False))
    g = graphed.runner.decode_graphs

    def as_captured(host, ids, lora):
        n = len(ids)
        g._load(host, ids, n, g.bucket(n), lora)
        return g._forward(g.bucket(n))[:n]  # no host lengths, as in capture

    g.run = as_captured
    prompts = varied_prompts(eager.model_config.vocab_size, count=3, lengths=(3, 17, 40))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert graphed.generate(prompts, params) == eager.generate(prompts, params)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="captures CUDA graphs: needs a GPU (and TRITON_INTERPRET=0)")
def test_captured_graphs_match_eager_on_cuda(tiny_engine_factory):
    eager = tiny_engine_factory("llama", max_num_seqs=16, device="cuda", enforce_eager=True)
    graphed = tiny_engine_factory("llama", max_num_seqs=16, device="cuda")
    assert graphed.runner.decode_graphs is not None and graphed.runner.decode_graphs.graphs
    prompts = varied_prompts(eager.model_config.vocab_size, count=13)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert graphed.generate(prompts, params) == eager.generate(prompts, params)
