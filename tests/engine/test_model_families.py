"""Every model family beyond the dense Llama shape (mixture-of-experts, long-context
RoPE) through the same engine, against transformers on a tiny random checkpoint in
float32: greedy tokens identical in mixed batches with chunked prompts, with prefix
hits and preemption, once through the compiled CPU path, and across two
tensor-parallel ranks (experts split between them)."""
from __future__ import annotations

import pytest

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.attention.paged_batch import DEVICE, needs_kernel_device
from tests.support.reference import (assert_same_tokens, load_reference, reference_greedy,
                                     varied_prompts)

FAMILIES = ["mixtral", "qwen2moe", "qwen3moe", "qwen2yarn", "mistralwin", "gemma2", "gemma3",
            "gptoss", "phi3", "deepseekv2", "deepseekv3"]
# qwen2yarn serves 256 positions (YaRN x4 over 64): prompts and outputs fit in them,
# and most prompts pass the original 64.
LENGTHS = (1, 3, 17, 31, 33, 64, 100, 129, 150, 180)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def family(request, tiny_model_dir):
    """(model directory, transformers' model) of one family, made once a module."""
    return tiny_model_dir(request.param), load_reference(tiny_model_dir(request.param))


def reference(ref, prompts, params) -> list[list[int]]:
    return [reference_greedy(ref, p, s.max_tokens) for p, s in zip(prompts, params)]


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_greedy_matches_transformers_chunked_and_batched(family):
    model_dir, ref = family
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=512,
                                 max_num_batched_tokens=37))  # prompts chunked
    prompts = varied_prompts(engine.model_config.vocab_size, count=12, lengths=LENGTHS)
    params = [greedy(48)] * len(prompts)
    assert engine.generate(prompts, params) == reference(ref, prompts, params)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


# Families whose every layer has a window let go of the blocks it has passed: a
# smaller cache still makes them preempt.
CACHE_BLOCKS = {"mistralwin": 9, "phi3": 10}
# Sliding-window layers between full-attention ones: their layer groups let go of
# the blocks their window has passed (kvcache/hybrid.py), and a block holds one
# group's layers: a smaller cache still makes them preempt.
HYBRIDS = {"gemma2": 22, "gemma3": 22, "gptoss": 22}


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_prefix_hits_and_preemption_keep_the_tokens(family, request):
    """Pairs of prompts sharing 40 tokens (the second of each hits the cache), in a
    cache too small for all of them at once (requests are preempted and resumed)."""
    model_dir, ref = family
    name = request.node.callspec.params["family"]
    blocks = {**CACHE_BLOCKS, **HYBRIDS}.get(name, 24)
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=blocks,
                                 block_size=16, max_num_batched_tokens=64, max_num_seqs=16))
    vocab = engine.model_config.vocab_size
    shared = varied_prompts(vocab, count=4, seed=7, lengths=(40,))
    tails = varied_prompts(vocab, count=8, seed=8, lengths=(5, 19, 33, 2))
    prompts = [shared[i // 2] + tails[i] for i in range(8)]
    params = [greedy(20 + 6 * (i % 3)) for i in range(8)]
    assert engine.generate(prompts, params) == reference(ref, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.stats.prefix_hits > 0
    assert (engine.scheduler.kv.stats.window_dropped > 0) == (name in {*CACHE_BLOCKS, *HYBRIDS})
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2yarn", "gemma2", "gptoss", "deepseekv3"],
                         indirect=True)
def test_compiled_path_matches_transformers(family):
    model_dir, ref = family
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=512,
                                 max_num_batched_tokens=37, compile="wait"))
    assert engine.runner.compiled is not None, "the forward pass did not compile"
    prompts = varied_prompts(engine.model_config.vocab_size, count=6, seed=3,
                             lengths=LENGTHS[::2])
    params = [greedy(32)] * len(prompts)
    got = engine.generate(prompts[:1], params[:1])  # batch 1: the direct graph
    got += engine.generate(prompts[1:], params[1:])  # mixed steps, then decode graphs
    assert_same_tokens(ref, prompts, got, reference(ref, prompts, params))


@pytest.mark.parametrize("family", ["qwen2moe", "mixtral", "gptoss", "deepseekv2", "deepseekv3"],
                         indirect=True)
def test_two_ranks_split_the_experts(family):
    model_dir, ref = family
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", compile="off",
                                 num_kv_blocks=256, max_num_batched_tokens=64,
                                 tensor_parallel_size=2, device="cpu"))
    deaths: list[str] = []
    engine.on_rank_death(deaths.append)
    try:
        sparse = next(l.mlp for l in engine.runner.model.layers if hasattr(l.mlp, "experts"))
        assert sparse.experts.w13.shape[0] == engine.model_config.moe.num_experts // 2
        prompts = varied_prompts(engine.model_config.vocab_size, count=6, seed=4,
                                 lengths=(3, 17, 70, 129))
        params = [greedy(24)] * len(prompts)
        assert engine.generate(prompts, params) == reference(ref, prompts, params)
    finally:
        engine.close()
    assert not deaths, deaths


def test_lora_reaches_the_attention_of_a_moe_model(tiny_model_dir, tmp_path):
    """Qwen3-MoE: an adapter on q, v and o equals PEFT's merged model; one on a
    sparse layer's MLP is refused (PEFT itself fuses such targets into the experts
    under transformers 5)."""
    from peft import PeftModel

    from kvserve.engine.config.lora_config import LoRAConfig
    from kvserve.engine.lora.adapter import LoRAAdapterError, load_adapter, projection_shapes
    from kvserve.engine.config.model_config import ModelConfig
    from tests.engine.lora.test_adapter import make_adapter

    base = tiny_model_dir("qwen3moe")
    deltas = make_adapter(base, tmp_path / "a", seed=1, r=8, lora_alpha=16,
                          target_modules=["q_proj", "v_proj", "o_proj"])
    assert {(1, "q_proj"), (3, "o_proj")} <= set(deltas)  # sparse layers' attention
    merged = PeftModel.from_pretrained(load_reference(base), str(tmp_path / "a"))
    merged = merged.merge_and_unload().eval()
    lora = LoRAConfig(True, (("a", str(tmp_path / "a")),), max_loras=1, max_rank=8)
    engine = Engine(EngineConfig(model=str(base), num_kv_blocks=256, lora=lora))
    prompts = varied_prompts(engine.model_config.vocab_size, count=3, seed=9)
    for prompt in prompts:
        engine.add_request(str(len(prompt)), prompt, greedy(16), lora_name="a")
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for prompt in prompts:
        assert got[str(len(prompt))] == reference_greedy(merged, prompt, 16)
    dense = tiny_model_dir("llama")
    make_adapter(dense, tmp_path / "mlp", r=8, target_modules=["gate_proj"])
    cfg = ModelConfig.from_pretrained(dense)
    with pytest.raises(LoRAAdapterError, match="'gate_proj' of layer 0, a mixture-of-exp"):
        load_adapter("mlp", tmp_path / "mlp", 8, cfg.num_layers, projection_shapes(cfg),
                     sparse_layers=frozenset({0}))


def test_latent_attention_caches_latents_only(tiny_model_dir, caplog):
    """DeepSeek-V3's cache holds one latent and rotary key a token and layer, the
    tensor passed as both K and V; fp8 caches are refused for it."""
    import logging

    from kvserve.engine.runner.memory_budget import full_kv_bytes_per_token
    from kvserve.modelstore.errors import ModelLoadError

    with caplog.at_level(logging.INFO, logger="kvserve"):
        engine = Engine(EngineConfig(model=str(tiny_model_dir("deepseekv3")), num_kv_blocks=64))
    cfg = engine.model_config
    attn = engine.runner.model.layers[0].self_attn
    assert attn.k_cache is attn.v_cache
    assert attn.k_cache.shape[2:] == (1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
    from kvserve.engine.models.kv_caches import KVCacheFormat

    per_token = KVCacheFormat(attn.k_cache.dtype).bytes_per_block(cfg, 16) / 16
    assert per_token == cfg.num_layers * 40 * 4  # (32 + 8) float32 values a layer
    assert full_kv_bytes_per_token(cfg, 4) == cfg.num_layers * 4 * (24 + 16) * 4
    assert "latent attention: " in caplog.text and "(4.0x less)" in caplog.text
    with pytest.raises(ModelLoadError, match="fp8 is not supported for latent attention"):
        Engine(EngineConfig(model=str(tiny_model_dir("deepseekv3")), num_kv_blocks=64,
                            kv_cache_dtype="fp8"))


@pytest.mark.parametrize("family", ["gptoss", "deepseekv3", "gemma2"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "early-exit"])
def test_speculative_decoding_keeps_the_tokens(family, method):
    """Drafts verified several rows a request at a time (windows, sinks, soft-caps,
    latents and experts over query spans of k + 1), on repetitive prompts that
    n-gram drafts hit."""
    from kvserve.engine.config.engine_config import SpeculativeConfig

    model_dir, ref = family
    spec = SpeculativeConfig(method, num_tokens=3, ngram_min=1, draft_layers=1)
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=256, speculative=spec))
    prompts = [[7, 8, 9, 10] * 8, [3, 4] * 20, [11, 12, 13] * 11]
    params = [greedy(24)] * len(prompts)
    assert engine.generate(prompts, params) == reference(ref, prompts, params)
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_a_windowed_model_serves_requests_longer_than_its_cache(tiny_model_dir):
    """Every layer windowed (24 tokens): blocks the window has passed go back to
    the pool, so 10 blocks (160 tokens) serve 300-token requests, still equal to
    transformers, and every block comes back at the end."""
    model_dir = tiny_model_dir("mistralwin")
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=10, block_size=16,
                                 max_num_batched_tokens=32))
    assert engine.max_model_len > 10 * 16
    _serves_300_token_requests(engine, model_dir)


def _serves_300_token_requests(engine, model_dir) -> None:
    """Two requests of 300 tokens equal to transformers, blocks let go of on the
    way, every block back at the end."""
    prompts = varied_prompts(engine.model_config.vocab_size, count=2, seed=11,
                             lengths=(250, 190))
    params = [greedy(50)] * 2
    ref = load_reference(model_dir)
    assert engine.generate(prompts, params) == reference(ref, prompts, params)
    assert engine.scheduler.kv.stats.window_dropped > 0
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("name", ["gemma3", "gptoss"])
def test_a_hybrid_model_holds_longer_requests_in_the_same_memory(tiny_model_dir, name):
    """Sliding layers between full ones (3 layers: sliding, full, sliding; window
    24): a block holds one layer group, and the sliding groups let go of what their
    window has passed, so the bytes of 12 blocks of every layer (192 tokens) hold
    300-token requests, still equal to transformers; every block comes back."""
    from kvserve.engine.config.model_config import ModelConfig

    model_dir = tiny_model_dir(name)
    cfg = ModelConfig.from_pretrained(str(model_dir))
    tensors, heads, dim = cfg.kv_cache_dims()
    every_layer = tensors * cfg.num_layers * 16 * heads * dim * 4  # a block, float32
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_memory=12 * every_layer,
                                 block_size=16, max_num_batched_tokens=32))
    assert engine.scheduler.kv.num_blocks == 36  # one layer a block, three groups
    assert engine.max_model_len > 12 * 16
    _serves_300_token_requests(engine, model_dir)
    # vLLM's switch back: one table, a block of every layer, the cache caps the context
    one = Engine(EngineConfig(model=str(model_dir), kv_cache_memory=12 * every_layer,
                              block_size=16, disable_hybrid_kv_cache_manager=True))
    assert (one.scheduler.kv.num_blocks, one.max_model_len) == (12, 12 * 16)
    assert not one.scheduler.kv.live_group_tables("any")


@needs_kernel_device
def test_a_hybrid_models_layer_groups_through_the_triton_kernels(tiny_model_dir):
    """Each layer's group's tables and slots reach the Triton kernels (interpreted on
    CPU): prompts past the window, chunked, beside decodes."""
    model_dir = tiny_model_dir("gemma3")
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, attention_backend="triton",
                                 enforce_eager=True, num_kv_blocks=64,
                                 max_num_batched_tokens=32))
    prompts = varied_prompts(engine.model_config.vocab_size, count=3, seed=5,
                             lengths=(60, 33, 5))
    params = [greedy(12)] * len(prompts)
    ref = load_reference(model_dir)
    got = engine.generate(prompts, params)
    assert_same_tokens(ref, prompts, got, reference(ref, prompts, params))
    assert engine.scheduler.kv.stats.window_dropped > 0


@needs_kernel_device
def test_latent_attention_through_the_triton_kernels(tiny_model_dir, monkeypatch):
    """DeepSeek-V3's long prompt chunks expanded per head on the Triton path
    (interpreted on CPU), its short ones and decodes absorbed, in the same steps."""
    from kvserve.engine.kernels.attention import triton_backend

    expanded_chunks = []

    def counted(*args, **kwargs):
        expanded_chunks.extend(count for _, count, _ in args[7])  # the runs
        return expand(*args, **kwargs)

    expand = triton_backend.expanded_prefill
    monkeypatch.setattr(triton_backend, "expanded_prefill", counted)
    model_dir = tiny_model_dir("deepseekv3")
    engine = Engine(EngineConfig(model=str(model_dir), device=DEVICE, attention_backend="triton",
                                 enforce_eager=True, num_kv_blocks=64,
                                 max_num_batched_tokens=48))
    prompts = varied_prompts(engine.model_config.vocab_size, count=3, seed=6,
                             lengths=(90, 40, 5))
    params = [greedy(8)] * len(prompts)
    ref = load_reference(model_dir)
    got = engine.generate(prompts, params)
    assert_same_tokens(ref, prompts, got, reference(ref, prompts, params))
    assert expanded_chunks  # chunks past 32 queries (the tiny widths' break-even)


def test_a_draft_model_that_sees_everything_keeps_every_block(tiny_model_dir):
    """A full-attention draft model reads the same block tables: nothing is let go
    of (its drafts would read blocks the window dropped), and the cache caps the
    context again."""
    from kvserve.engine.config.engine_config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft", model=str(tiny_model_dir("llama")), num_tokens=2)
    engine = Engine(EngineConfig(model=str(tiny_model_dir("mistralwin")), num_kv_blocks=10,
                                 block_size=16, max_num_batched_tokens=32, speculative=spec))
    assert engine.scheduler.kv.sliding_window == 0
    assert engine.max_model_len == 10 * 16
