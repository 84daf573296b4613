"""A fault in one request (an exception while its batch is prepared, its token drawn
or decoded, or NaN logits from the model) fails that request alone: it finishes with
reason "error" and a message, its blocks are freed, and every other request of the
batch gets exactly the tokens (and logprobs) it gets when nothing fails. A fault
that hits every request of a step is the engine's: the step raises. All of it holds
under async scheduling too (the `engine` fixture runs both ways)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.platform import faults
from kvserve.engine.sampling.sampler import _non_finite, _peaks
from kvserve.scheduler.sampling_params import SamplingParams

PROMPTS = {"greedy": [5, 6, 7, 8], "seeded": [9, 10, 11],
           "logprobs": [12, 13, 14, 15, 16], "forked": [17, 18]}
PARAMS = {"greedy": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          "seeded": SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
          "logprobs": SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                                     prompt_logprobs=1, ignore_eos=True),
          "forked": SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2,
                                   ignore_eos=True)}
VICTIM = [20, 21, 22, 23, 24, 25]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Each sequence's outputs, folded: {(name, index): {tokens, logprobs, ...}}."""
    for name, (prompt, params) in requests.items():
        engine.add_request(name, prompt, params)
    seqs: dict = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seq = seqs.setdefault((o.request_id, o.index),
                                  {"tokens": [], "logprobs": []})
            seq["tokens"] += o.new_token_ids
            seq["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or ()]
            if o.prompt_logprobs is not None:
                seq["prompt_logprobs"] = [p and (p.token_id, p.logprob, p.top)
                                          for p in o.prompt_logprobs]
            if o.finished:
                seq["finish"], seq["error"] = o.finish_reason, o.error
    return seqs


def others() -> dict:
    return {k: (PROMPTS[k], PARAMS[k]) for k in PROMPTS}


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks  # KV usage back to zero
    assert not engine.runner.sampler._generators and not len(engine.runner.sampler.prompt)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request, tiny_engine_factory):
    return tiny_engine_factory("llama", max_num_batched_tokens=64,
                               async_scheduling=request.param)


@pytest.fixture(scope="module")
def clean(engine):
    """The outputs of the batch (victim included) when nothing fails."""
    out = run(engine, {**others(), "victim": (VICTIM, PARAMS["greedy"])})
    assert_idle(engine)
    return out


def assert_same_except(out: dict, clean: dict, failed: str) -> None:
    """Every sequence but `failed`'s: the same tokens, finish and logprob ids, and
    logprobs within float noise (a batch of another size may differ in the last
    bits)."""
    assert {k for k in out if k[0] != failed} == {k for k in clean if k[0] != failed}
    for key, seq in out.items():
        if key[0] != failed:
            assert _exact(seq) == _exact(clean[key]), key
            assert _values(seq) == pytest.approx(_values(clean[key]), abs=1e-4), key


def _exact(seq: dict) -> dict:
    lps = [(i, [t for t, _ in top]) for i, _, top in seq["logprobs"]]
    prompt = [p and (p[0], [t for t, _ in p[2]]) for p in seq.get("prompt_logprobs") or ()]
    return {**seq, "logprobs": lps, "prompt_logprobs": prompt}


def _values(seq: dict) -> list[float]:
    lps = [*seq["logprobs"], *filter(None, seq.get("prompt_logprobs") or ())]
    return [v for _, lp, top in lps for v in (lp, *(x for _, x in top))]


@pytest.mark.parametrize("where", faults.POINTS)
@pytest.mark.parametrize("after_tokens", [0, 3])
def test_a_fault_fails_its_request_alone(engine, clean, where, after_tokens):
    victim = faults.prompt_is(VICTIM)
    match = lambda req: victim(req) and req.num_output_tokens >= after_tokens  # noqa: E731
    with faults.armed(match, where, message="boom"):
        out = run(engine, {**others(), "victim": (VICTIM, PARAMS["greedy"])})
    assert out[("victim", 0)]["finish"] == "error"
    assert "InjectedFault: boom (request victim)" == out[("victim", 0)]["error"]
    got = out[("victim", 0)]["tokens"]
    # Async scheduling prepares and samples a step before the last one's token is
    # counted: the fault may land one token later.
    slack = 1 if engine.config.async_scheduling and after_tokens else 0
    assert after_tokens <= len(got) <= after_tokens + slack
    assert got == clean[("victim", 0)]["tokens"][:len(got)]
    assert_same_except(out, clean, "victim")
    assert_idle(engine)


def test_a_forking_parent_fails_with_its_siblings(engine, clean):
    with faults.armed(faults.prompt_is(PROMPTS["forked"])):
        out = run(engine, {**others(), "victim": (VICTIM, PARAMS["greedy"])})
    assert [out[("forked", i)]["finish"] for i in (0, 1)] == ["error", "error"]
    assert_same_except(out, clean, "forked")
    assert_idle(engine)


def test_a_fault_in_every_request_of_a_step_is_the_engines(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    with faults.armed(lambda req: True):
        for name, (prompt, params) in others().items():
            engine.add_request(name, prompt, params)
        with pytest.raises(faults.InjectedFault):
            engine.step()


def test_a_disarmed_fault_point_is_the_plain_method():
    """The points cost nothing outside tests: no check runs, the method is the
    method; only while a fault is armed at a point does a wrapper stand there."""
    from kvserve.engine.runner.model_runner import ModelRunner
    from kvserve.engine.sampling import Sampler

    def points():
        return ModelRunner.prepare, Sampler._sample, Sampler._finish

    plain = points()
    assert all(not hasattr(p, "__wrapped__") and p.__name__ != "tripped" for p in plain)
    with faults.armed(lambda req: False, "prepare"):
        assert points()[0] is not plain[0] and points()[1:] == plain[1:]
    assert points() == plain
    with pytest.raises(ValueError):
        faults.arm(lambda req: True, "nowhere")


def test_non_finite_rows():
    inf = float("inf")
    logits = torch.tensor([[0.0, 1.0, 2.0],  # fine
                           [-inf, 1.0, -inf],  # fine: -inf is a legitimate mask
                           [0.0, float("nan"), 1.0],
                           [0.0, inf, 1.0],
                           [-inf, -inf, -inf]])
    assert _non_finite(logits).tolist() == [0, 0, 1, 1, 1]


def test_one_pass_gives_the_first_argmax_with_the_flags():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0]])
    top, bad = _peaks(logits)
    assert top.tolist() == logits.argmax(-1).tolist() == [1, 0]
    assert bad.tolist() == [0, 0]


# -- NaN logits from the model itself ----------------------------------------------
def poisoned_copy(model_dir, dest, token: int):
    """The model with token `token`'s embedding made NaN: any sequence that holds the
    token gets NaN hidden states (attention spreads it along that sequence only)."""
    shutil.copytree(model_dir, dest)
    weights = load_file(str(dest / "model.safetensors"))
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_logits_fail_their_request_alone(tiny_model_dir, tmp_path, clean,
                                             async_scheduling):
    seen = {t for seq in clean.values() for t in seq["tokens"]}
    seen |= {t for p in PROMPTS.values() for t in p}
    poison = next(t for t in range(100, 300) if t not in seen)
    model = poisoned_copy(tiny_model_dir("llama"), tmp_path / "poisoned", poison)
    engine = Engine(EngineConfig(model=str(model), num_kv_blocks=512,
                                 max_num_batched_tokens=64,
                                 async_scheduling=async_scheduling))
    out = run(engine, {**others(), "victim": ([30, poison, 31], PARAMS["greedy"])})
    assert out[("victim", 0)] == {"tokens": [], "logprobs": [], "finish": "error",
                                  "error": out[("victim", 0)]["error"]}
    assert "NaN/inf" in out[("victim", 0)]["error"]
    assert_same_except(out, clean, "victim")
    assert_idle(engine)
