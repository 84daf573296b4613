"""Pipeline parallelism on CPU (gloo): greedy output token-identical to one process
in float32 on the default model at P=2 and P=3, and on the tiny model at T=2 x P=2,
through chunked prefill, prefix-cache hits, preemption and n>1 (copy-on-write
forks), with P steps really in flight; each stage holding only its layers.

The engines are pinned to the CPU (as the tensor-parallel tests are: a fake or
real GPU would put the other ranks on cuda devices), and a rank that dies fails its
test instead of ending pytest."""
from __future__ import annotations

import pytest

from kvserve.engine.config.engine_config import EngineConfig, SpeculativeConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.models.pipeline_stage import AbsentPart, head_in_layers, split_layers
from kvserve.modelstore.errors import ModelLoadError
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.parallel.test_tensor_parallel import engine as tp_engine
from tests.engine.parallel.test_tensor_parallel import prompts, tp_config

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine(model_dir, pp: int, **overrides):
    """The tensor-parallel tests' engine (float32, eager, on the CPU, a rank's death
    failing the test), in pp stages (of tensor_parallel_size ranks each, if given)."""
    return tp_engine(model_dir, overrides.pop("tensor_parallel_size", 1),
                     pipeline_parallel_size=pp, **overrides)


def pp_config(model_dir, pp: int, **overrides) -> EngineConfig:
    return tp_config(model_dir, 1, pipeline_parallel_size=pp, **overrides)


def watch_in_flight(e: Engine) -> list[int]:
    """Records how many steps were in flight whenever the oldest is finished."""
    seen: list[int] = []
    finish = e.runner.finish

    def counting(step):
        seen.append(len(e._staged) + 1)  # (the one being finished left the queue)
        return finish(step)

    e.runner.finish = counting
    return seen


def run(e: Engine, batch: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """(tokens, prefix-cache hits, preemptions): 16 greedy prompts, the first of each
    pair ahead of the seconds (their shared prefix is cached when they come), then a
    prompt forked three ways (seeded sampling: the siblings differ, each reproducible)."""
    order = batch[0::2] + batch[1::2]
    tokens = e.generate(order, GREEDY)
    forked = e.generate(batch[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=7,
                                                   ignore_eos=True, n=3))
    stats = e.scheduler.stats()
    return tokens + forked, stats.prefix_hits, stats.num_preemptions


def assert_same_as_one_process(model_dir, pp: int, vocab: int, staged: dict | None = None,
                               **overrides) -> None:
    """overrides: both engines' settings; staged: the pipeline's alone."""
    batch = prompts(vocab)
    assert max(map(len, batch)) > 64  # chunked
    with engine(model_dir, 1, **overrides) as e:
        want, hits_one, _ = run(e, batch)
    with engine(model_dir, pp, **overrides, **(staged or {})) as e:
        in_flight = watch_in_flight(e)
        got, hits, preempted = run(e, batch)
        assert max(in_flight) == pp  # every stage had a step of its own at once
        assert e.scheduler.kv.num_free_blocks == e.scheduler.kv.num_blocks  # none held
    assert hits > 0 and hits_one > 0  # (how many: as the steps fell, which differ)
    if "num_kv_blocks" in overrides:
        assert preempted > 0
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"sequence {i} differs"
    assert got[-3] != got[-2]  # (the siblings are not all one)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 3])
def test_stages_match_one_process_default_model(default_model_dir, pp):
    # SmolLM2-135M: 30 layers, tied embeddings (the last stage keeps the embedding as
    # its LM head). 28 blocks of 16 tokens for 16 prompts of up to 116 tokens + 24
    # generated: requests are preempted and recomputed.
    assert_same_as_one_process(default_model_dir, pp, vocab=49152, num_kv_blocks=28,
                               quantization="none")


def test_two_by_two_ranks_match_one_process_tiny(tiny_model_dir):
    # T=2 x P=2: each stage's layers split over two ranks, all-reduced in the stage's
    # own group; both ranks of the first stage get every step, the last stage's
    # second rank its hidden states from the first stage's second.
    assert_same_as_one_process(tiny_model_dir("llama"), 2, vocab=300,
                               staged={"tensor_parallel_size": 2})


def test_each_stage_holds_only_its_layers(default_model_dir):
    with engine(default_model_dir, 3) as e:
        model = e.runner.model
        held = [i for i, layer in enumerate(model.layers) if not isinstance(layer, AbsentPart)]
        # The last stage's LM head is 8 layers' worth of a decode: it takes 5 layers.
        assert held == list(range(25, 30)) == list(range(*split_layers(30, 3, 8.0)[2]))
        assert len(e.runner.kv_caches) == 5  # its layers' KV only
        assert model.stage.last and not isinstance(model.norm, AbsentPart)
        # Tied embeddings: the head's weight is the embedding's, kept here for it.
        assert model.lm_head.weight is model.embed_tokens.weight
        params = sum(p.numel() for p in model.parameters())
        assert params < 0.4 * 134.5e6  # the embedding and 5 of 30 layers


def test_layers_split_so_the_last_stage_runs_its_head_too(default_model_dir):
    from kvserve.engine.config.model_config import ModelConfig

    head = head_in_layers(ModelConfig.from_pretrained(str(default_model_dir)))
    assert 7.5 < head < 8.5  # 49152 x 576 against a layer's 3.5 M multiply-adds
    assert split_layers(30, 2, head) == [(0, 19), (19, 30)]  # 19 against 11 + 8
    assert split_layers(30, 3, head) == [(0, 13), (13, 25), (25, 30)]
    # Without a head to weigh: even, the earlier stages taking the rest.
    assert split_layers(30, 4) == [(0, 8), (8, 15), (15, 22), (22, 30)]
    assert split_layers(3, 3, 100.0) == [(0, 1), (1, 2), (2, 3)]  # one layer at least
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        split_layers(2, 3)


def test_unsupported_combinations_are_refused(tiny_model_dir):
    model = tiny_model_dir("llama")
    with pytest.raises(ModelLoadError, match="weight quantization"):
        Engine(pp_config(model, 2, quantization="int8"))
    with pytest.raises(ModelLoadError, match="speculative decoding"):
        Engine(pp_config(model, 2, speculative=SpeculativeConfig("ngram")))
    with pytest.raises(ModelLoadError, match="random weights"):  # each its own draw
        Engine(pp_config(model, 2, load_format="random"))
