"""Adapters served by the engine: greedy output of each, alone and mixed in one batch
with the base model, token-identical (float32) to PEFT's merged model in
transformers, through chunked prefill, prefix hits, preemption and slot eviction;
the prefix cache never crosses adapters."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from peft import PeftModel

from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.lora.test_adapter import make_adapter
from tests.support.reference import load_reference, reference_greedy, varied_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Ranks 8 and 16, different targets; every one changes the KV of layer 1 at least.
ADAPTERS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all16": dict(r=16, lora_alpha=32, target_modules=ALL),
    "mlp8": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "down_proj"]),
    "ko16": dict(r=16, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(base dir, {name: adapter dir}, {name or None: reference model})."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items(), 1):
        make_adapter(base, root / name, seed=seed, **lora)
        paths[name] = str(root / name)
    references = {None: load_reference(base)}
    for name, path in paths.items():
        merged = PeftModel.from_pretrained(load_reference(base), path).merge_and_unload()
        references[name] = merged.eval()
    return base, paths, references


def lora_engine(factory, paths, **overrides):
    lora = LoRAConfig(True, tuple(paths.items()), max_loras=overrides.pop("max_loras", 4),
                      max_rank=16)
    return factory("llama", dtype="float32", lora=lora, **overrides)


def run(engine, jobs: list[tuple[list[int], str | None]], params=GREEDY) -> list[list[int]]:
    """Greedy continuations of (prompt, adapter) pairs, all added at once."""
    out: dict[str, list[int]] = {f"j{i}": [] for i in range(len(jobs))}
    for i, (prompt, name) in enumerate(jobs):
        engine.add_request(f"j{i}", prompt, params, lora_name=name)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return list(out.values())


def expected(references, jobs, params=GREEDY) -> list[list[int]]:
    return [reference_greedy(references[name], prompt, params.max_tokens)
            for prompt, name in jobs]


def mixed_jobs(vocab_size: int, seed: int = 0, count: int = 10):
    names = [None, *ADAPTERS]
    prompts = varied_prompts(vocab_size, count=count, seed=seed)
    return [(p, names[i % len(names)]) for i, p in enumerate(prompts)]


def test_each_adapter_alone_matches_peft_merged(tiny_engine_factory, served):
    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths)
    for name in ADAPTERS:
        jobs = [(p, name) for p in varied_prompts(engine.model_config.vocab_size, 2, seed=3)]
        assert run(engine, jobs) == expected(refs, jobs), name


def test_four_adapters_and_the_base_in_one_batch_with_chunked_prefill(
        tiny_engine_factory, served):
    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths, max_num_batched_tokens=48)
    jobs = mixed_jobs(engine.model_config.vocab_size)
    assert run(engine, jobs) == expected(refs, jobs)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_prefix_hits_stay_within_an_adapter(tiny_engine_factory, served):
    """The same 64-token prompt under each adapter and the base: only a repeat under
    the same adapter hits the cache, and every answer is its own model's."""
    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths)
    prompt = varied_prompts(engine.model_config.vocab_size, 1, seed=5, lengths=(64,))[0]
    names = [None, *ADAPTERS]
    for name in names:
        run(engine, [(prompt, name)])
        cached = _cached_tokens(engine, prompt, name)
        assert cached == 48, (name, cached)  # its own earlier run: three whole blocks
    jobs = [(prompt, name) for name in names]
    assert run(engine, jobs) == expected(refs, jobs)


def _cached_tokens(engine, prompt, name) -> int:
    """Prompt tokens the prefix cache serves a new request for (prompt, name)."""
    engine.add_request("probe", prompt, SamplingParams(max_tokens=2), lora_name=name)
    engine.step()
    cached = engine.scheduler.requests["probe"].num_cached_tokens
    while engine.has_unfinished_requests():
        engine.step()
    return cached


def test_a_block_of_one_adapter_is_never_a_hit_for_another(tiny_engine_factory, served):
    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths)
    prompt = varied_prompts(engine.model_config.vocab_size, 1, seed=6, lengths=(80,))[0]
    run(engine, [(prompt, "all16")])
    for other in (None, "qv8", "ko16"):
        assert _cached_tokens(engine, prompt, other) == 0, other
        assert run(engine, [(prompt, other)]) == expected(refs, [(prompt, other)])


def test_preemption_and_fewer_slots_than_adapters(tiny_engine_factory, served):
    """A cache too small for every request at once (preemptions, recomputed under
    the right adapter), and two slots for four adapters (the scheduler runs at most
    two adapters at a time, slots are taken over least recently used first)."""
    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths, num_kv_blocks=20, max_loras=2,
                         max_num_batched_tokens=64)
    jobs = mixed_jobs(engine.model_config.vocab_size, seed=7, count=12)
    jobs = [(p[:150], name) for p, name in jobs]
    assert run(engine, jobs) == expected(refs, jobs)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_padded_decode_graph_path_adds_each_rows_adapter(tiny_engine_factory, served):
    """Decode-only steps through the static buffers CUDA graphs are captured on (run
    uncaptured here): rows of four adapters and of the base model, padded rows."""
    from kvserve.engine.runner.cuda_graphs import DecodeGraphPlan

    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths)
    engine.runner.use_decode_graphs(DecodeGraphPlan(8, engine.max_model_len, capture=False))
    calls = []
    run_graphs = engine.runner.decode_graphs.run
    engine.runner.decode_graphs.run = lambda *a: calls.append(a[2]) or run_graphs(*a)
    jobs = mixed_jobs(engine.model_config.vocab_size, seed=10, count=7)  # bucket 8
    assert run(engine, jobs) == expected(refs, jobs)
    assert calls and all(c is not None for c in calls)  # adapters in every step
    calls.clear()
    base_only = [(p, None) for p, _ in jobs[:3]]
    assert run(engine, base_only) == expected(refs, base_only)
    assert calls and all(c is None for c in calls)  # the graphs without LoRA


def test_unknown_adapter_is_refused(tiny_engine_factory, served):
    _, paths, _ = served
    engine = lora_engine(tiny_engine_factory, paths)
    with pytest.raises(ValueError, match="nope"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora_name="nope")
    base = tiny_engine_factory("llama", dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        base.add_request("x", [5, 6, 7], GREEDY, lora_name="qv8")


def test_unloading_waits_for_the_requests_using_it(tiny_engine_factory, served):
    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, paths)
    prompt = varied_prompts(engine.model_config.vocab_size, 1, seed=8, lengths=(40,))[0]
    engine.add_request("a", prompt, GREEDY, lora_name="all16")
    tokens = []
    for o in engine.step():
        tokens += o.new_token_ids
    engine.unload_lora("all16")
    with pytest.raises(ValueError, match="all16"):
        engine.add_request("b", prompt, GREEDY, lora_name="all16")
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
    assert tokens == expected(refs, [(prompt, "all16")])[0]
    assert "all16" not in engine.lora.names
    engine.load_lora("all16", paths["qv8"])  # the name again, another adapter
    assert run(engine, [(prompt, "all16")]) == expected(refs, [(prompt, "qv8")])


def test_dense_gathered_and_kernel_paths_agree(served):
    """The CPU's masked matmuls, its per-token gather (compiled decode steps) and the
    BGMV Triton kernels (the interpreter here) on the same slots and tokens."""
    from kvserve.engine.config.model_config import ModelConfig
    from kvserve.engine.lora.manager import LoRAManager

    base, paths, _ = served
    cfg = ModelConfig.from_pretrained(base)
    config = LoRAConfig(True, tuple(paths.items()), max_loras=4, max_rank=16)
    dense = LoRAManager(config, cfg, torch.device("cpu"), torch.float32, kernels="dense")
    kernel = LoRAManager(config, cfg, torch.device("cpu"), torch.float32, kernels="triton")
    keys = [None, *(dense.key_of(n) for n in ADAPTERS)]
    lens = [3, 1, 4, 2, 5]
    steps = [m.step_inputs(keys, lens) for m in (dense, kernel)]
    torch.manual_seed(0)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for group, fan_in, fan_out in (("qkv", cfg.hidden_size, q + 2 * kv),
                                   ("gate_up", cfg.hidden_size, 2 * cfg.intermediate_size),
                                   ("down", cfg.intermediate_size, cfg.hidden_size)):
        x = torch.randn(sum(lens), fan_in)
        y = torch.randn(sum(lens), fan_out)
        by_matmuls, by_kernels = (s.add(group, 1, x, y) for s in steps)
        assert torch.allclose(by_matmuls, by_kernels, atol=1e-4), group
        gathered = replace(steps[0], per_token=True).add(group, 1, x, y)
        assert torch.allclose(by_matmuls, gathered, atol=1e-4), group
        assert torch.equal(by_matmuls[:3], y[:3])  # the base model's rows: untouched
        assert not torch.equal(by_matmuls[3:], y[3:])


def test_compiled_graphs_take_adapters_without_recompiling(tiny_engine_factory, served):
    """Compiled steps (the dense product traced into the graphs, built with LoRA
    twins before the first step): the same tokens as PEFT's merged models, decode
    batches of one and of many, mixed steps; no graph compiled after the build, and
    a load (new weights in a slot) reaches the compiled steps."""
    from kvserve.engine.runner.compile_process import graphs_compiled

    from tests.engine.test_compiled_forward import assert_same_tokens

    _, paths, refs = served
    engine = lora_engine(tiny_engine_factory, {k: paths[k] for k in ("qv8", "all16")},
                         compile="wait", max_num_batched_tokens=40, max_loras=2)
    built = graphs_compiled()
    jobs = mixed_jobs(engine.model_config.vocab_size, seed=9, count=6)
    jobs = [(p, name if name in ("qv8", "all16") else None) for p, name in jobs]
    single = jobs[1:2]
    for batch in (single, jobs):
        got = run(engine, batch)
        for (prompt, name), tokens in zip(batch, got):
            assert_same_tokens(refs[name], [prompt], [tokens], expected(refs, [(prompt, name)]))
    engine.unload_lora("qv8")
    engine.load_lora("late", paths["mlp8"])
    got = run(engine, [(jobs[0][0], "late")])
    assert_same_tokens(refs["mlp8"], [jobs[0][0]], got, expected(refs, [(jobs[0][0], "mlp8")]))
    assert graphs_compiled() == built


@pytest.mark.slow
def test_the_default_model_with_two_adapters_matches_peft_merged(default_model_dir,
                                                                 tmp_path):
    """SmolLM2-135M with two adapters (rank 8 on q/v, rank 16 everywhere) and the
    base model in one batch, chunked: token-identical to PEFT's merged models."""
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    specs = {"qv8": ADAPTERS["qv8"], "all16": ADAPTERS["all16"]}
    refs = {None: load_reference(default_model_dir)}
    for seed, (name, spec) in enumerate(specs.items(), 20):
        make_adapter(default_model_dir, tmp_path / name, seed=seed, **spec)
        merged = PeftModel.from_pretrained(load_reference(default_model_dir),
                                           str(tmp_path / name)).merge_and_unload()
        refs[name] = merged.eval()
    lora = LoRAConfig(True, tuple((n, str(tmp_path / n)) for n in specs), max_loras=2)
    engine = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                 max_num_batched_tokens=96, lora=lora))
    prompts = varied_prompts(engine.model_config.vocab_size, count=6, seed=4)
    jobs = [(p, [None, "qv8", "all16"][i % 3]) for i, p in enumerate(prompts)]
    assert run(engine, jobs, GREEDY) == expected(refs, jobs, GREEDY)
