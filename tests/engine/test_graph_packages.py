"""The compiled graphs as AOTInductor packages (engine/runner/graph_packages.py,
packaged_forward.py, engine/core/package_builder.py; --compile-cache packages): built by a child
process, then greedy output token-identical to eager steps through prompt chunks,
prefix hits and every batch size; a second engine (a warm start) loads the packages
with no build and no Dynamo graph, with the same output, and 200 random arrivals
then run through them; through preemption the output is transformers'; the key
covers the weights; a failed build is not retried.

Tiny random-weight model, float32: on kvserve's packed GEMM wherever it runs (auto's
choice on AVX2 CPUs, --cpu-kernels kvserve on AVX-512 ones; called as an op from the
package, whose constants are the model's own tensors, bound at load) and, where
torch does the GEMMs, with the weights frozen into the packages."""
from __future__ import annotations

import json
import logging
import random
import zipfile
from collections import Counter

import pytest
import torch

from kvserve.engine.runner.compile_process import graphs_compiled
from kvserve.engine.runner.graph_packages import GraphPackages, PackagedGraph, applies, unpack
from kvserve.engine.runner.package_constants import BOUND, model_tensors
from kvserve.engine.runner.packaged_forward import PackagedForward
from kvserve.engine.weights.cpu_packing import kernels_run_here
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import (assert_same_tokens, load_reference, reference_greedy,
                                     varied_prompts)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# kvserve's GEMM wherever it runs: unfrozen graphs, whose packages share the weights
KERNELS = "kvserve" if kernels_run_here("auto", torch.device("cpu")) else "auto"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvserve-cache")


@pytest.fixture(scope="module")
def make(tiny_model_dir, cache):
    """make(**EngineConfig overrides) -> an engine whose graphs are packages under
    `cache` (built before the first step)."""
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    def build(**overrides):
        cfg = dict(model=str(tiny_model_dir("llama")), num_kv_blocks=256,
                   max_num_batched_tokens=37, compile="wait", compile_cache="packages",
                   cpu_kernels=KERNELS)
        cfg.update(overrides)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVSERVE_CACHE", str(cache))
            engine = Engine(EngineConfig(**cfg))
        compiled = engine.runner.compiled
        assert compiled is not None and set(compiled.packages.graphs) == {
            "decode_one", "decode_many", "hidden"}
        return engine

    return build


@pytest.fixture(scope="module")
def first(make):
    return make()


def prompts_with_a_shared_prefix(vocab: int) -> list[list[int]]:
    prompts = varied_prompts(vocab)[:6]
    return prompts + [prompts[0] + [5, 6, 7], prompts[1][:40] + [9] * 20]


def run(engine, prompts, size):
    out = []
    for i in range(0, len(prompts), size):
        out += engine.generate(prompts[i:i + size], GREEDY)
    return out


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_packages_give_eager_tokens(batch, first, tiny_engine_factory):
    """Prompts chunked at 37 tokens (mixed steps through the hidden graph), decodes of
    one request and of several, prefix hits (the last two prompts share blocks)."""
    prompts = prompts_with_a_shared_prefix(first.model_config.vocab_size)
    eager = tiny_engine_factory(max_num_batched_tokens=37, compile="off", cpu_kernels=KERNELS)
    assert run(first, prompts, batch) == run(eager, prompts, batch)
    assert first.scheduler.kv.num_free_blocks == first.scheduler.kv.num_blocks


def test_packages_through_preemption_match_transformers(make, tiny_model_dir):
    """A KV cache too small for the batch (requests preempted and recomputed) loads
    the same packages (their block count is dynamic), and greedy output is
    transformers' in float32 (parting only at a float32 tie, as vLLM's tests allow)."""
    prompts = varied_prompts(400, count=32, seed=32, lengths=(12, 40, 77, 100, 5, 63))
    params = [SamplingParams(max_tokens=16 + (i * 7) % 40, temperature=0.0,
                             ignore_eos=True) for i in range(32)]
    tight = make(num_kv_blocks=40, max_num_seqs=32)
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    ref = load_reference(tiny_model_dir("llama"))
    assert_same_tokens(ref, prompts, got, [reference_greedy(ref, p, n.max_tokens)
                                           for p, n in zip(prompts, params)])


def test_a_warm_start_loads_the_packages(first, make, cache, caplog):
    """The second engine finds every package under its key: no build process is
    started, Dynamo builds no graph, and the tokens are the first engine's. Each
    package is kept unpacked (its library and the library's .json), nothing else."""
    for kind in ("decode_one", "decode_many", "hidden"):
        (folder,) = cache.glob(f"graphs/*/{kind}")
        assert [p.suffix for p in folder.glob("*.wrapper.*")].count(".so") == 1
        assert list(folder.glob("*.wrapper.json")) and (folder.parent / "key.json").exists()
        # frozen graphs (torch's GEMMs) keep their constants; others bind the model's
        assert (folder / BOUND).exists() == (not first.runner.compiled.frozen)
        # and AOTInductor's copy of the library is gone from Inductor's cache
        (library,) = folder.glob("*.so")
        assert not list(cache.rglob(f"inductor/*/*/{library.name}"))
    if not first.runner.compiled.frozen:  # each graph reads the model's own tensors
        owned = {t.data_ptr() for t in model_tensors(first.runner.model).values()}
        for graph in first.runner.compiled.packages.graphs.values():
            constants = graph.runner.extract_constants_map(False).values()
            assert constants and {t.data_ptr() for t in constants} <= owned
    assert [p for p in cache.rglob("*") if ".partial" in p.name or p.suffix == ".pt2"] == []
    prompts = prompts_with_a_shared_prefix(first.model_config.vocab_size)
    want = run(first, prompts, 4)
    dynamo_graphs = graphs_compiled()
    with caplog.at_level(logging.INFO, logger="kvserve.compile"):
        second = make()
    assert "process of their own" not in caplog.text
    assert caplog.text.count("loaded the") == 3
    assert run(second, prompts, 4) == want
    assert graphs_compiled() == dynamo_graphs


def test_random_arrivals_on_a_warm_start_take_only_packages(first, make, monkeypatch):
    """200 requests of random lengths arriving at random steps on an engine that
    loaded its packages: every step runs through them (no Dynamo graph; eager only
    a step of one prompt token, as on Dynamo's path), whatever its batch size,
    token count or context."""
    engine = make()
    calls = Counter()
    monkeypatch.setattr(PackagedGraph, "__call__",
                        lambda self, *step, _call=PackagedGraph.__call__:
                        calls.update([len(step)]) or _call(self, *step))
    model, eager_tokens = engine.runner.model, []
    eager = model.forward
    monkeypatch.setattr(model, "forward", lambda ids, *a, **k:
                        eager_tokens.append(len(ids)) or eager(ids, *a, **k))
    rng = random.Random(200)
    vocab = engine.model_config.vocab_size
    pending = [([rng.randrange(5, vocab) for _ in range(rng.randrange(1, 120))],
                SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0,
                               ignore_eos=True)) for _ in range(200)]
    dynamo_graphs, added = graphs_compiled(), 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 3])):
            if pending:
                engine.add_request(f"arrival-{added}", *pending.pop())
                added += 1
        engine.step()
    assert added == 200 and graphs_compiled() == dynamo_graphs
    assert calls[2] and calls[5]  # mixed steps (ids, positions); decodes (+ paged)
    # (a step of one prompt token, not a decode, is eager on either path)
    assert set(eager_tokens) <= {1}
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_the_key_covers_the_weights_and_the_graph(first, tmp_path):
    """Another value in one weight, another graph or other options: another key."""
    runner = first.runner
    packages = GraphPackages(runner.model, tmp_path)
    key = packages.key("hidden", {})
    assert key == GraphPackages(runner.model, tmp_path).key("hidden", {})
    assert key != packages.key("decode_one", {}) != packages.key("hidden", {"x": 1})
    weight = runner.model.layers[0].post_attention_layernorm.weight
    with torch.no_grad():
        saved = weight.view(-1)[0].item()
        weight.view(-1)[0] += 1.0
        try:
            assert GraphPackages(runner.model, tmp_path).key("hidden", {}) != key
        finally:
            weight.view(-1)[0] = saved


def test_frozen_weights_for_torch_gemms(make, tiny_engine_factory):
    """Where torch does the GEMMs (AVX-512 CPUs under --cpu-kernels auto) the weights
    are frozen into the packages, prepacked for oneDNN: eager tokens still."""
    engine = make(cpu_kernels="torch")  # (another key: other weights, other options)
    assert engine.runner.compiled.frozen
    prompts = prompts_with_a_shared_prefix(engine.model_config.vocab_size)
    eager = tiny_engine_factory(max_num_batched_tokens=37, compile="off",
                                cpu_kernels="torch")
    assert run(engine, prompts, 3) == run(eager, prompts, 3)


def test_a_new_build_removes_the_same_models_older_packages(first, tmp_path):
    """An upgrade builds packages under new keys; the old ones (the same model and
    kind) go, another model's stay."""
    store = GraphPackages(first.runner.model, tmp_path)
    old, other = tmp_path / "old", tmp_path / "other-model"
    for folder, weights in ((old, store.facts["weights"]), (other, "another")):
        folder.mkdir()
        (folder / "key.json").write_text(json.dumps(
            {**store.facts, "weights": weights, "engine": "older", "kind": "hidden"}))
    kept = tmp_path / "new"
    kept.mkdir()
    store._prune("hidden", kept)
    assert not old.exists() and other.exists() and kept.exists()


def test_a_failed_build_is_not_tried_again(first, tmp_path):
    """A build that fails leaves a marker under the key: the next start raises at
    once (Dynamo's graphs are built instead) rather than failing the same build."""
    compiled, tries = first.runner.compiled, []

    def failing_build():
        tries.append(1)
        raise RuntimeError("the build process exited 1: no kernel for this op")

    packaged = PackagedForward(GraphPackages(first.runner.model, tmp_path), failing_build)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no kernel for this op"):
            packaged.build_all(compiled._package_plan(), run_step=None)
    assert tries == [1] and packaged.store.failure_marker().exists()


def test_only_where_each_layer_has_a_kv_pair_and_no_lora(first):
    model = first.runner.model
    assert applies(model, torch.device("cpu"), lora=False)
    assert not applies(model, torch.device("cpu"), lora=True)
    assert not applies(model, torch.device("meta"), lora=False)


def test_a_package_without_a_library_is_not_unpacked(tmp_path):
    package = tmp_path / "hidden.pt2"
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr("hidden/data/aotinductor/model/x.wrapper.json", "{}")
    with pytest.raises(RuntimeError, match="holds no compiled library"):
        unpack(package, tmp_path / "key" / "hidden")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["hidden.pt2", "key"]
