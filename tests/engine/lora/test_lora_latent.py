"""LoRA on latent attention (engine/models/mla.py): DeepSeek-V3's shape (the query's
low-rank pair q_a_proj / q_b_proj) and DeepSeek-V2-Lite's (q_proj), adapters on the
query, the latent's projection (kv_a_proj_with_mqa) and o_proj, served beside the
base model: greedy output token-identical (float32) to
PEFT's merged model in transformers, through chunked prefill, prefix hits,
preemption and the compiled decode graphs. kv_b_proj, which decode folds into the
queries and outputs, is refused with the targets this model takes."""
from __future__ import annotations

import pytest
from peft import PeftModel

from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.lora.adapter import LoRAAdapterError, load_adapter, projection_shapes
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.lora.test_adapter import make_adapter
from tests.support.reference import load_reference, reference_greedy, varied_prompts

# The attention's projections. (The dense first layer's MLP takes adapters as every
# family's MLP does; PEFT under transformers 5 turns an MLP pattern here into the
# sparse layers' fused experts, which kvserve refuses, so it is left out.)
TARGETS = {
    "deepseekv3": r".*self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)",
    "deepseekv2": r".*self_attn\.(q_proj|kv_a_proj_with_mqa|o_proj)",
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def latent(request, tiny_model_dir, tmp_path_factory):
    """(family, adapter dir, {None: base, "a": PEFT merged} reference models)."""
    family = request.param
    base = tiny_model_dir(family)
    path = tmp_path_factory.mktemp(f"lora-{family}") / "a"
    deltas = make_adapter(base, path, seed=3, r=8, lora_alpha=16,
                          target_modules=TARGETS[family])
    assert {layer for layer, _ in deltas} == {0, 1, 2}
    assert "kv_a_proj_with_mqa" in {m for _, m in deltas}
    merged = PeftModel.from_pretrained(load_reference(base), str(path)).merge_and_unload()
    return family, str(path), {None: load_reference(base), "a": merged.eval()}


def _engine(factory, family, path, **overrides):
    lora = LoRAConfig(True, (("a", path),), max_loras=2, max_rank=8)
    return factory(family, dtype="float32", lora=lora, **overrides)


def run(engine, jobs) -> tuple[list[list[int]], int]:
    """Greedy continuations of (prompt, adapter) pairs added at once, and the prompt
    tokens the prefix cache served them."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {f"j{i}": [] for i in range(len(jobs))}
    cached: dict[str, int] = {}
    for i, (prompt, name) in enumerate(jobs):
        engine.add_request(f"j{i}", prompt, params, lora_name=name)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            cached.setdefault(o.request_id, o.num_cached_tokens)
    return list(out.values()), sum(cached.values())


def _expected(references, jobs, max_tokens=24):
    return [reference_greedy(references[name], prompt, max_tokens) for prompt, name in jobs]


def test_adapters_on_latent_attention_match_peft_merged(tiny_engine_factory, latent):
    """Adapter and base requests in one batch, prompts chunked over several steps,
    then the same prompts again (prefix hits, each within its own adapter)."""
    family, path, refs = latent
    engine = _engine(tiny_engine_factory, family, path, max_num_batched_tokens=40)
    prompts = varied_prompts(engine.model_config.vocab_size, count=4, seed=11,
                             lengths=(70, 33, 90, 12))
    jobs = [(p, name) for p in prompts for name in ("a", None)]
    want = _expected(refs, jobs)
    assert run(engine, jobs) == (want, 0)
    again, cached = run(engine, jobs)
    assert again == want and cached >= 2 * (64 + 32 + 80)  # whole blocks, both sides
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_latent_adapters_through_preemption_and_compiled_graphs(tiny_engine_factory, latent):
    family, path, refs = latent
    if family != "deepseekv3":  # (V2-Lite's q_proj path: the test above; suite time)
        pytest.skip("one family through preemption and the compiled graphs")
    small = _engine(tiny_engine_factory, family, path, num_kv_blocks=14,
                    max_num_batched_tokens=64)
    prompts = varied_prompts(small.model_config.vocab_size, count=6, seed=12,
                             lengths=(60, 75, 40, 90, 55, 66))
    jobs = [(p, "a" if i % 3 else None) for i, p in enumerate(prompts)]
    want = _expected(refs, jobs)
    assert run(small, jobs)[0] == want
    assert small.scheduler.num_preemptions > 0
    compiled = _engine(tiny_engine_factory, family, path, compile="wait")
    assert compiled.runner.compiled is not None
    assert run(compiled, jobs)[0] == want


def test_kv_b_proj_is_refused_with_the_targets_a_latent_model_takes(tiny_model_dir,
                                                                    tmp_path):
    base = tiny_model_dir("deepseekv3")
    make_adapter(base, tmp_path / "kvb", r=8, target_modules=["kv_b_proj"])
    cfg = ModelConfig.from_pretrained(base)
    with pytest.raises(LoRAAdapterError, match="targets 'kv_b_proj'; supported for this "
                       "model: o_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, gate_proj"):
        load_adapter("kvb", tmp_path / "kvb", 8, cfg.num_layers, projection_shapes(cfg))
    # and a Llama adapter's k_proj has nothing to reach here
    make_adapter(tiny_model_dir("llama"), tmp_path / "k", r=8, target_modules=["k_proj"])
    with pytest.raises(LoRAAdapterError, match="targets 'k_proj'"):
        load_adapter("k", tmp_path / "k", 8, cfg.num_layers, projection_shapes(cfg))
