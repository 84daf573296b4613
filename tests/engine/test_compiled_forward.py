"""The Inductor-compiled forward pass (engine/runner/compiled_model.py) and the compiled
paged decode attention: greedy output token-identical to the eager float32 path and
to transformers, in every shape of step; no recompilation under a random workload.

Tiny random-weight model, float32. The compiled graphs are built before the first
step (compile="wait"), so every step after that goes through them.

"Identical" has one exception, as in vLLM's tests: a sequence may part from the other
at a tie, where the two tokens' logits (transformers', float32, as the arbiter) are
closer than float32 rounding can tell apart; the compiled GEMMs sum in another order
than eager's (and Inductor's autotuning may pick another kernel from run to run)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from kvserve.engine.config.engine_config import SpeculativeConfig
from kvserve.engine.runner.compile_process import graphs_compiled
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import (assert_same_tokens, load_reference, reference_greedy,
                                     varied_prompts)

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return load_reference(tiny_model_dir("llama"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def compiled_factory(tiny_model_dir):
    """make(**EngineConfig overrides) -> an engine whose graphs are compiled."""
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    def make(**overrides):
        cfg = dict(model=str(tiny_model_dir("llama")), num_kv_blocks=512,
                   max_num_batched_tokens=37, compile="wait")  # odd chunks
        cfg.update(overrides)
        engine = Engine(EngineConfig(**cfg))
        assert engine.runner.compiled is not None, "the forward pass did not compile"
        return engine

    return make


@pytest.fixture(scope="module")
def compiled(compiled_factory):
    return compiled_factory()


def run_in_batches(engine, prompts, params, size):
    out = []
    for i in range(0, len(prompts), size):
        out += engine.generate(prompts[i:i + size], params)
    return out


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 16])
def test_greedy_matches_eager_and_transformers_at_every_batch_size(
        batch, compiled, tiny_engine_factory, ref):
    """16 prompts x 64 tokens, run `batch` at a time: decode steps of every size up
    to 16 (batch 1 has a graph of its own), prompts chunked at 37 tokens."""
    prompts = varied_prompts(compiled.model_config.vocab_size)
    got = run_in_batches(compiled, prompts, GREEDY_64, batch)
    eager = tiny_engine_factory(max_num_batched_tokens=37, compile="off")
    assert_same_tokens(ref, prompts, got, run_in_batches(eager, prompts, GREEDY_64, batch))
    if batch == 16:
        assert_same_tokens(ref, prompts, got,
                           [reference_greedy(ref, p, 64) for p in prompts])
    assert compiled.scheduler.kv.num_free_blocks == compiled.scheduler.kv.num_blocks


def test_prefix_hits_give_the_same_tokens(compiled):  # the same graphs: exact
    shared = varied_prompts(compiled.model_config.vocab_size, count=1, seed=5,
                            lengths=(70,))[0]
    prompts = [shared + tail for tail in varied_prompts(
        compiled.model_config.vocab_size, count=6, seed=6, lengths=(3, 9, 20))]
    first = compiled.generate(prompts, greedy(24))
    hits_before = compiled.scheduler.kv.stats.prefix_hits
    again = compiled.generate(prompts, greedy(24))
    assert compiled.scheduler.kv.stats.prefix_hits > hits_before
    assert again == first


def test_preemption_gives_the_same_tokens(compiled_factory, tiny_engine_factory, ref):
    prompts = varied_prompts(400, count=32, seed=32, lengths=(12, 40, 77, 100, 5, 63))
    params = [greedy(16 + (i * 7) % 40) for i in range(32)]
    tight = compiled_factory(num_kv_blocks=40, max_num_seqs=32)
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    eager = tiny_engine_factory(num_kv_blocks=40, max_num_seqs=32,
                                max_num_batched_tokens=37, compile="off")
    assert_same_tokens(ref, prompts, got, eager.generate(prompts, params))


def test_speculative_verification_gives_the_same_tokens(compiled_factory,
                                                        tiny_engine_factory, ref):
    """n-gram drafts on repetitive prompts: verification steps (k + 1 query rows
    per request) run through the compiled mixed-step graph."""
    spec = SpeculativeConfig("ngram", num_tokens=3, ngram_min=1)
    prompts = [[7, 8, 9, 10] * 6, [3, 4] * 10, [11, 12, 13] * 7]
    got = compiled_factory(speculative=spec).generate(prompts, greedy(32))
    eager = tiny_engine_factory(max_num_batched_tokens=37, compile="off")
    assert_same_tokens(ref, prompts, got, eager.generate(prompts, greedy(32)))


def test_each_engine_runs_graphs_of_its_own(compiled_factory, tiny_engine_factory):
    """Dynamo's guards on the model are dropped (engine/runner/compiled_model.py), so a
    second engine in the process must never reach the first one's graphs (and their
    frozen weights): two engines of other weights each give their own eager tokens."""
    prompts = varied_prompts(400, count=4, seed=9, lengths=(5, 30))
    for seed in (1, 2):
        got = compiled_factory(load_format="random", seed=seed).generate(prompts, greedy(12))
        eager = tiny_engine_factory(load_format="random", seed=seed,
                                    max_num_batched_tokens=37, compile="off")
        assert got == eager.generate(prompts, greedy(12)), f"seed {seed}"


def test_weights_are_frozen_only_for_torch_gemms(compiled_factory, ref):
    """Frozen weights (prepacked for oneDNN) where torch multiplies; where kvserve's
    packed GEMM does, the weights stay graph inputs and a second engine takes its
    graphs from Inductor's cache instead of tracing and lowering them again."""
    from torch._dynamo.utils import counters

    from kvserve.engine.weights.cpu_packing import packing_wanted

    prompts = varied_prompts(400, count=3, seed=4, lengths=(5, 30))
    torch_gemms = compiled_factory(cpu_kernels="torch")
    assert torch_gemms.runner.compiled.frozen
    assert torch_gemms.runner.compiled.cpp_wrapper  # built so, not fallen back
    if not packing_wanted("auto", torch.device("cpu"), torch.float32):
        pytest.skip("kvserve's CPU kernels do not run on this CPU")
    first = compiled_factory(cpu_kernels="kvserve")
    hits = counters["inductor"]["fxgraph_cache_hit"]
    second = compiled_factory(cpu_kernels="kvserve")
    assert not first.runner.compiled.frozen and not second.runner.compiled.frozen
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == 3  # all three graphs
    got = second.generate(prompts, greedy(24))
    assert_same_tokens(ref, prompts, got, torch_gemms.generate(prompts, greedy(24)))


def test_graphs_are_cpp_and_check_no_input_sizes_at_each_call(compiled_factory):
    """On CPU each graph's wrapper is C++ (its ~250 calls a default-model decode
    step cost ~1 ms more in Python). The model's tensors never change once the
    graphs are built: Inductor's per-call asserts of each input's size, strides and
    alignment (~520 a batch-1 step of the default model, ~0.6 ms) are left out, as
    Dynamo's guards on the model are; the step's own inputs keep their guards."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes = []  # (torch's run_and_get_code would reset Dynamo: other tests' graphs)
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        engine = compiled_factory(load_format="random", seed=5)
    assert engine.runner.compiled.cpp_wrapper
    assert len(codes) >= 3  # the three graphs, loaded from the cache or built
    assert all("CppWrapperCodeCache" in c for c in codes)
    assert not any("assert_size_stride(" in c or "assert_alignment(" in c for c in codes)


def test_attention_op_writes_the_kv_cache_in_place(compiled_factory):
    """kvserve::paged_attention declares the caches it writes, so Inductor may never
    reorder a read of them around it, and it writes them where they lie: the mixed
    step's graph allocates no copy of a cache (a clone of every layer's cache a step
    would cost more than the step). Steps write the caches the runner holds."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    schema = torch.ops.kvserve.paged_attention.default._schema
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == {"k_cache", "v_cache"}
    codes = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        engine = compiled_factory(load_format="random", seed=6)
    mixed = [c for c in codes if "kvserve::paged_attention" in c]
    assert mixed, "no graph calls the attention op"
    blocks, block_size, kv_heads, head_dim = engine.runner.kv_caches[0][0].shape
    cache_shape = f"{{{blocks}L, {block_size}L, {kv_heads}L, {head_dim}L}}"
    assert not any(cache_shape in c for c in mixed), "a KV cache was copied"
    before = [k.clone() for k, _ in engine.runner.kv_caches]
    ptrs = [k.data_ptr() for k, _ in engine.runner.kv_caches]
    engine.generate(varied_prompts(400, count=2, seed=6, lengths=(40, 70)), greedy(3))
    assert [k.data_ptr() for k, _ in engine.runner.kv_caches] == ptrs
    assert all(not torch.equal(b, k) for b, (k, _) in zip(before, engine.runner.kv_caches))


def test_batch_one_decode_steps_call_their_graph_past_dynamo(compiled, tiny_engine_factory,
                                                             ref):
    """engine/runner/direct_graph.py: once built, the batch-1 graph is called with the
    model's tensors it took then and each step's inputs, not through Dynamo's frame
    (~0.7 ms a default-model step); the tokens stay the eager path's."""
    from unittest import mock

    model = compiled.runner.compiled
    assert model.direct_one is not None
    prompts = varied_prompts(compiled.model_config.vocab_size, count=2, seed=3,
                             lengths=(4, 40))
    through_dynamo = []
    with mock.patch.object(model, "_one", side_effect=through_dynamo.append):
        got = [compiled.generate([p], greedy(40))[0] for p in prompts]  # tables widen
    assert through_dynamo == []
    eager = tiny_engine_factory(max_num_batched_tokens=37, compile="off")
    assert_same_tokens(ref, prompts, got, [eager.generate([p], greedy(40))[0] for p in prompts])


def test_every_graph_drops_dynamo_s_guards_on_the_model(tiny_engine_factory):
    """torch.compile takes guard_filter_fn out of the options it is given: each graph
    must be given its own copy (the mixed-step graph once got none, and checked ~30
    guards a layer at every call)."""
    from unittest import mock

    from kvserve.engine.runner.compiled_model import CompiledModel, _unguarded_model

    model = tiny_engine_factory(compile="off").runner.model
    real, filters = torch.compile, []

    def compile_spy(fn, **kwargs):
        filters.append((kwargs.get("options") or {}).get("guard_filter_fn"))
        return real(fn, **kwargs)

    for paged in (False, True):
        filters.clear()
        with mock.patch("torch.compile", compile_spy):
            CompiledModel(model, paged_decode=paged, cpp_wrapper=True)
        assert filters == [_unguarded_model] * 3


def test_cuda_graphs_take_neither_cpu_gemm_options_nor_freezing(tiny_engine_factory):
    """On CUDA the batch-1 graph is built with Inductor's defaults (the CPP GEMM
    template has no CUDA kernel: it would fail once, then be built again) and the
    weights are not frozen (frozen graphs are never cached). Nothing is compiled:
    torch.compile builds at the first call."""
    from kvserve.engine.runner.compiled_model import CompiledModel

    model = tiny_engine_factory(compile="off", cpu_kernels="torch").runner.model
    with torch._inductor.config.patch(freezing=torch._inductor.config.freezing):
        cpu = CompiledModel(model, cpp_wrapper=True)
        cuda = CompiledModel(model, device=torch.device("cuda"))
    assert cpu.frozen and cpu.batch_one_options["max_autotune_gemm_backends"] == "CPP"
    assert not cuda.frozen
    assert not {"max_autotune", "max_autotune_gemm_backends", "cpp_wrapper"} & set(
        cuda.batch_one_options)


def test_graphs_fall_back_to_python_wrappers(tiny_engine_factory):
    """If Inductor cannot build a graph with a C++ wrapper, the graphs are built
    again with Python ones: compiled steps all the same, not eager ones. (Nothing is
    compiled here: run_step never calls the graph it is given.)"""
    from kvserve.engine.runner.compiled_model import CompiledModel

    compiled = CompiledModel(tiny_engine_factory(compile="off").runner.model,
                             cpp_wrapper=True)
    built_with = []

    def run_step(fn, num_tokens, decode, lora):
        built_with.append(compiled.cpp_wrapper)
        if compiled.cpp_wrapper:
            raise RuntimeError("no C++ wrapper here")

    compiled.build(run_step, background=False)
    assert built_with == [True, False, False, False]  # the failed graph, then all three
    assert compiled.ready.is_set() and compiled.failed is None
    assert not compiled.cpp_wrapper and "cpp_wrapper" not in compiled.options


def test_random_arrivals_trigger_no_recompilation(compiled):
    """200 requests of random lengths arriving at random steps, after warm-up."""
    rng = random.Random(200)
    vocab = compiled.model_config.vocab_size
    pending = [([rng.randrange(5, vocab) for _ in range(rng.randrange(1, 120))],
                greedy(rng.randrange(1, 40))) for _ in range(200)]
    before = graphs_compiled()
    added = 0
    while pending or compiled.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 3])):
            if pending:
                prompt, params = pending.pop()
                compiled.add_request(f"arrival-{added}", prompt, params)
                added += 1
        compiled.step()
    assert added == 200
    assert graphs_compiled() == before
    assert compiled.scheduler.kv.num_free_blocks == compiled.scheduler.kv.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_matches_the_gathering_reference(dtype):
    """The compiled kernel against the torch backend's gather + SDPA, for batch 1
    and 7, contexts of one block to several, shuffled block tables, GQA."""
    from kvserve.engine.kernels.attention.cpu_paged import paged_decode
    from kvserve.engine.kernels.attention.step_metadata import context_slots
    from kvserve.engine.kernels.attention.torch_backend import _decode

    gen = torch.Generator().manual_seed(0)
    blocks, bs, hkv, hq, d = 64, 4, 2, 6, 16
    k_cache = torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype)
    for lens in ([3], [1, 4, 5, 9, 17, 30, 2]):
        b, width = len(lens), -(-max(lens) // bs)
        tables = torch.randperm(blocks, generator=gen)[:b * width].reshape(b, width).int()
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(b, hq, d, generator=gen).to(dtype)
        key_pos = torch.arange(max(lens)).expand(b, -1)
        slots = context_slots(tables, key_pos.minimum(seq_lens[:, None].long() - 1), bs)
        mask = (key_pos < seq_lens[:, None])[:, None, None, :]
        want = _decode(q, k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots],
                       mask, d ** -0.5)
        got = paged_decode(q, k_cache, v_cache, tables, seq_lens, d ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_background_compile_serves_eagerly_meanwhile(tiny_model_dir, ref):
    """compile="background" (auto on CPU): the engine steps at once, eagerly, while
    the graphs are warmed up on their own thread over the spare block; then its steps
    go through them, with the same tokens, and no block of a live request was touched."""
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=512,
                                 max_num_batched_tokens=37, compile="background"))
    building = engine.runner.compiling
    assert building is not None
    prompts = varied_prompts(engine.model_config.vocab_size, count=8, seed=11)
    runs = [engine.generate(prompts, greedy(48))]  # eager steps beside the warm-ups
    while not building.ready.is_set() and building.failed is None and len(runs) < 500:
        runs.append(engine.generate(prompts, greedy(48)))
    assert building.failed is None, f"the forward pass did not compile: {building.failed}"
    assert building.ready.wait(600), "the forward pass did not compile in time"
    assert engine.runner.compiled is building
    compiled_before = graphs_compiled()
    after = engine.generate(prompts, greedy(48))
    assert graphs_compiled() == compiled_before  # no recompilation: the graphs served
    for during in runs:
        assert_same_tokens(ref, prompts, during, after)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("decode", [True, False])
def test_warm_up_steps_touch_only_the_spare_block(tiny_engine_factory, decode):
    """The graphs are warmed up beside live steps (background compile): their steps
    may read and write the spare block alone, never one the KV manager hands out."""
    engine = tiny_engine_factory(compile="off", num_kv_blocks=64)
    runner = engine.runner
    for k, v in runner.kv_caches:  # every block marked, so any write shows
        k.normal_(), v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    def eager(ids, positions, paged=None):
        return runner.model(ids, positions, paged=paged)

    for backend in (runner.attn_backend, type(runner.attn_backend)(in_place=True)):
        for tokens in (1, 16, 256):
            runner._warm_up_step(backend, eager, tokens, decode)
    live = slice(0, runner.spare_block)
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        assert torch.equal(k0[live], k1[live]) and torch.equal(v0[live], v1[live])
    assert any(not torch.equal(k0[runner.spare_block], k1[runner.spare_block])
               for (k0, _), (k1, _) in zip(before, runner.kv_caches))


def test_compiled_graphs_are_cached_per_version_of_kvserves_op_schemas(tmp_path, monkeypatch):
    """A graph calls kvserve's ops through the schemas it was compiled against, and
    Inductor's key does not cover them: a graph cached before an op changed
    segfaulted when loaded after. The cache directory is keyed by their sources."""
    from kvserve.engine.runner import compile_process

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compile_process.use_cache_dir(str(tmp_path))
    first = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert first == str(tmp_path / "inductor" / compile_process.ops_key())
    sources = tmp_path / "engine"
    for name in compile_process.OP_SOURCES:  # a copy of the sources, one op changed
        (sources / name).parent.mkdir(parents=True, exist_ok=True)
        text = (Path(compile_process.__file__).parents[1] / name).read_bytes()
        (sources / name).write_bytes(text + (b"# changed\n" if "moe" in name else b""))
    monkeypatch.setattr(compile_process, "__file__", str(sources / "runner" / "x.py"))
    compile_process.use_cache_dir(str(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] != first
