"""Async scheduling on the real engine (tiny model, CPU): step N+1 is scheduled and
launched before step N's tokens reach the host, its pending tokens fed from step N's
output on the device. Outputs must be exactly those of the synchronous engine, for
every feature (the steps that must see their tokens on the host first complete
before the next is planned), through chunked prompts, preemption and aborts."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.config.engine_config import EngineConfig, SpeculativeConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.platform import faults
from kvserve.engine.runner.cuda_graphs import DecodeGraphPlan
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.test_fault_isolation import _exact, _values, assert_idle, run
from tests.support.reference import varied_prompts


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


PROMPTS = varied_prompts(400, count=14, seed=40,
                         lengths=(5, 12, 33, 60, 700, 9, 21, 3, 48, 17, 26, 8, 40, 11))


# Requests whose steps always make the engine wait for them (r7, r8, r12).
DRAINING = {"r7", "r8", "r12"}


def mixed_requests(stop_token: int, eleventh: int
                   ) -> dict[str, tuple[list[int], SamplingParams]]:
    """Plain decodes (greedy, seeded, top-k/p), a prompt long enough to be chunked,
    one that meets a stop token nobody could foresee (a row of the next step is
    wasted), the features the next step needs nothing of on the host for (logprobs,
    logit_bias, min_tokens once reached), and those it does: n > 1, penalties,
    prompt logprobs (DRAINING)."""
    plain = [greedy(30), greedy(25),
             SamplingParams(max_tokens=28, temperature=1.0, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=6,
                            ignore_eos=True),
             greedy(12), greedy(40), greedy(1)]
    waiting_ones = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=8, n=3, ignore_eos=True),
        greedy(20, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
        # Stops at its 11th token, the first one min_tokens=10 lets through: a count
        # one token stale (async reading it before the last token is back) would
        # ban the stop token once more.
        SamplingParams(max_tokens=18, temperature=0.0, min_tokens=10,
                       stop_token_ids=[eleventh]),
        greedy(15, logit_bias={7: 5.0}),
        greedy(14, logprobs=3),
        greedy(10, prompt_logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token])]
    params = plain + waiting_ones
    return {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))}


def record_schedules(engine: Engine) -> list:
    """Every SchedulerOutput the engine plans, from now on."""
    planned, outs = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: outs.append(o := planned()) or o
    return outs


@pytest.fixture(scope="module")
def stop_token(tiny_engine_factory) -> int:
    """A token the last prompt's greedy continuation meets after a few others."""
    tokens = tiny_engine_factory().generate([PROMPTS[-1]], greedy(40))[0]
    return next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])


@pytest.fixture(scope="module")
def eleventh(tiny_engine_factory) -> int:
    """The 11th token of the min_tokens request's greedy continuation, which none of
    the 10 before it is."""
    tokens = tiny_engine_factory().generate([PROMPTS[9]], greedy(18))[0]
    assert tokens[10] not in tokens[:10]
    return tokens[10]


def workload(stop_token: int, eleventh: int, draining: bool) -> dict:
    requests = mixed_requests(stop_token, eleventh)
    return requests if draining else {k: v for k, v in requests.items()
                                      if k not in DRAINING}


@pytest.fixture(scope="module", params=[True, False], ids=["all", "no-draining"])
def case(request, tiny_engine_factory, stop_token, eleventh):
    """(the workload, the synchronous engine's outputs for it)."""
    requests = workload(stop_token, eleventh, request.param)
    engine = tiny_engine_factory(max_num_batched_tokens=128)
    out = run(engine, requests)
    assert out[("r13", 0)]["finish"] == "stop"
    assert out[("r9", 0)]["finish"] == "stop" and len(out[("r9", 0)]["tokens"]) == 11
    assert_idle(engine)
    return requests, out


def test_outputs_match_the_synchronous_engine(tiny_engine_factory, case):
    requests, sync_outputs = case
    engine = tiny_engine_factory(max_num_batched_tokens=128, async_scheduling=True)
    outs = record_schedules(engine)
    got = run(engine, requests)
    assert got.keys() == sync_outputs.keys()
    for key, seq in got.items():  # tokens, finish, logprob ids, then their values
        assert _exact(seq) == _exact(sync_outputs[key]), key
        assert _values(seq) == pytest.approx(_values(sync_outputs[key]), abs=1e-4), key
    assert_idle(engine)
    # It overlapped: many steps fed a token from the step before them.
    fed = [o for o in outs if any(s.num_pending for s in o.scheduled)]
    assert len(fed) > len(outs) // 3
    assert all(s.num_pending <= 1 for o in outs for s in o.scheduled)
    if DRAINING.isdisjoint(requests):  # logprobs, logit_bias, min_tokens overlapped
        fed_ids = {s.request.request_id for o in outs for s in o.scheduled if s.num_pending}
        assert {"r9", "r10", "r11"} <= fed_ids


def test_the_next_step_is_planned_before_the_last_one_is_read(tiny_engine_factory):
    engine = tiny_engine_factory(async_scheduling=True)
    calls: list[str] = []
    for obj, name in [(engine.scheduler, "schedule"), (engine.runner, "launch"),
                      (engine.runner, "finish")]:
        method = getattr(obj, name)
        setattr(obj, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    engine.add_request("a", [5, 6, 7], greedy(3))
    assert engine.step() == []  # the prompt's step is launched; nothing read yet
    first = engine.step()  # the first token's step is launched, then the prompt's read
    assert [o.new_token_ids for o in first] == [[engine.scheduler.requests["a"].token_ids[3]]]
    assert calls == ["schedule", "launch", "schedule", "launch", "finish"]
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graph-path"])
def test_tiny_kv_cache_preempts_and_outputs_match(tiny_engine_factory, graphs):
    """Preemption of requests whose token is still on its way, and, in the padded
    decode path CUDA graphs replay (uncaptured on CPU), the fed token in its buffer."""
    prompts = varied_prompts(400, count=32, seed=32, lengths=(12, 40, 77, 100, 5, 63))
    params = [greedy(16 + (i * 7) % 40) if i % 3 else
              SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(32)]
    tight = tiny_engine_factory(num_kv_blocks=40, max_num_seqs=32, async_scheduling=True)
    if graphs:
        tight.runner.use_decode_graphs(DecodeGraphPlan(32, tight.max_model_len, capture=False))
    together = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert_idle(tight)
    reference = tiny_engine_factory(max_num_seqs=32).generate(prompts, params)
    assert together == reference


def test_abort_while_its_step_is_in_flight(tiny_engine_factory):
    requests = {f"r{i}": (p, greedy(12)) for i, p in enumerate(
        varied_prompts(400, count=6, seed=41, lengths=(7, 19, 4, 30, 11, 23)))}
    reference = run(tiny_engine_factory(), requests)
    engine = tiny_engine_factory(async_scheduling=True)
    for name, (prompt, params) in requests.items():
        engine.add_request(name, prompt, params)
    tokens: dict[str, list[int]] = {}
    for _ in range(4):
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine._inflight is not None and any(
        s.request.request_id == "r2" for s in engine._inflight.out.scheduled)
    (aborted,) = engine.abort_request("r2")
    assert aborted.finished and aborted.finish_reason == "abort"
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id != "r2"
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert_idle(engine)
    assert tokens["r2"] == reference[("r2", 0)]["tokens"][:len(tokens["r2"])]
    for name in requests.keys() - {"r2"}:
        assert tokens[name] == reference[(name, 0)]["tokens"], name


def test_not_with_speculative_decoding(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=str(tiny_model_dir("llama")), async_scheduling=True,
                     speculative=SpeculativeConfig("ngram"))


# -- faults and aborts while a step is in flight --------------------------------------

def prompt(seed: int, length: int) -> list[int]:
    return varied_prompts(400, count=1, seed=seed, lengths=(length,))[0]


def test_abort_of_a_prompt_logprobs_request_mid_step(tiny_engine_factory):
    """Its prompt logprobs in progress are dropped while its chunk is in flight;
    the chunk's results must not fail the step or touch the other request's."""
    p0, p1 = prompt(50, 100), prompt(51, 100)
    outputs = {}
    for overlapped in (False, True):
        engine = tiny_engine_factory(max_num_batched_tokens=64,
                                     long_prefill_token_threshold=16,
                                     async_scheduling=overlapped)
        engine.add_request("p0", p0, greedy(3, prompt_logprobs=1))
        engine.add_request("p1", p1, greedy(3, prompt_logprobs=1))
        engine.step()
        engine.abort_request("p1")
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == "p0" and o.prompt_logprobs is not None:
                    outputs[overlapped] = [p and p.token_id for p in o.prompt_logprobs]
        assert_idle(engine)
    assert outputs[True] == outputs[False] == [None, *p0[1:]]


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_prepare_fault_leaves_no_unwritten_block_to_share(tiny_engine_factory, overlapped):
    """A request left out of its step at preparation wrote no KV, but its blocks were
    offered for sharing when the step was scheduled. A newcomer with the same prompt
    must not hit them (async: admitted while the step is in flight; here no cache hit
    and the right tokens), and one that already hit them in the same step fails
    instead of reading what nobody wrote."""
    victim = prompt(52, 65)
    want = tiny_engine_factory().generate([victim], greedy(8))[0]
    engine = tiny_engine_factory(async_scheduling=overlapped)
    engine.add_request("V", victim, greedy(8))
    engine.add_request("same-step", victim, greedy(8))
    outs = {}
    with faults.armed(lambda r: r.request_id == "V", "prepare", "boom"):
        outs.update((o.request_id, o) for o in engine.step())
        engine.add_request("next", victim, greedy(8))
        tokens = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o
                if o.request_id == "next":
                    tokens += o.new_token_ids
    assert outs["V"].finish_reason == "error"
    assert outs["same-step"].finish_reason == "error"
    assert "whose step failed" in outs["same-step"].error
    assert outs["next"].num_cached_tokens == 0 and tokens == want
    assert_idle(engine)


def test_a_prepare_fault_before_a_preemption_leaves_no_shared_block(tiny_engine_factory):
    """The failing request is preempted while its step is in flight: its blocks go
    back before the failure is read, and must not stay in the prefix cache."""
    victim, other = prompt(53, 65), prompt(54, 48)
    want = tiny_engine_factory().generate([victim], greedy(8))[0]
    engine = tiny_engine_factory(num_kv_blocks=8, async_scheduling=True)
    engine.add_request("A", other, greedy(3))
    engine.add_request("V", victim, greedy(8))
    with faults.armed(lambda r: r.request_id == "V", "prepare", "boom"):
        for _ in range(3):
            engine.step()
    assert engine.scheduler.num_preemptions == 1
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("C", victim, greedy(8))
    tokens = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 0 and tokens == want
    assert_idle(engine)


def test_a_lone_request_failing_at_preparation_on_the_decode_graph_path(
        tiny_engine_factory):
    """The step that failed sampled nothing, yet the next one was planned with the
    request's pending token: it reads a 0 there, and the request still fails."""
    engine = tiny_engine_factory(max_num_seqs=8, async_scheduling=True)
    engine.runner.use_decode_graphs(DecodeGraphPlan(8, engine.max_model_len, capture=False))
    engine.add_request("R", list(range(5, 30)), greedy(8))
    outs = []
    with faults.armed(lambda r: r.request_id == "R", "prepare", "boom"):
        while engine.has_unfinished_requests():
            outs += [(o.request_id, o.finish_reason) for o in engine.step()]
    assert outs == [("R", "error")]
    assert_idle(engine)


def random_workload(seed: int, count: int) -> list[tuple[int, str, list[int], SamplingParams]]:
    """(arrival step, id, prompt, params): every feature mixed, arrivals spread."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(3, 400) for _ in range(rng.choice([1, 5, 17, 40, 90, 200]))]
        kw = dict(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.5:
            kw.update(temperature=0.0)
        else:
            kw.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000),
                      top_p=rng.choice([1.0, 0.9]))
        feature = rng.random()
        if feature < 0.1:
            kw.update(n=2, temperature=1.0, seed=rng.randrange(1000))
        elif feature < 0.2:
            kw.update(logprobs=2)
        elif feature < 0.27:
            kw.update(presence_penalty=0.5)
        elif feature < 0.34:
            kw.update(min_tokens=min(kw["max_tokens"], 5), stop_token_ids=[rng.randrange(3, 400)])
        elif feature < 0.4:
            kw.update(prompt_logprobs=1)
        elif feature < 0.5:
            kw.update(stop_token_ids=[rng.randrange(3, 400) for _ in range(5)])
        out.append((rng.randrange(40), f"q{i}", prompt, SamplingParams(**kw)))
    return sorted(out, key=lambda x: x[0])


def run_random(engine: Engine, workload, aborts: dict[int, str]) -> dict:
    """Each sequence's tokens and finish reason; requests added at their arrival step,
    `aborts` (step -> request id) aborted then."""
    pending, seqs, step = list(workload), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        outputs = engine.abort_request(aborts[step]) if step in aborts else []
        for o in outputs + engine.step():
            seq = seqs.setdefault((o.request_id, o.index), {"tokens": []})
            seq["tokens"] += o.new_token_ids
            if o.finished:
                seq["finish"] = o.finish_reason
        step += 1
    return seqs


@pytest.mark.parametrize("seed", [1, 2])
def test_random_workloads_match_the_synchronous_engine(tiny_engine_factory, seed):
    """Random arrivals, every feature, a cache small enough to preempt, and aborts at
    random steps: every sequence not aborted gets the synchronous engine's tokens and
    finish reason; an aborted one a prefix of them; nothing leaks."""
    workload = random_workload(seed, 48)
    rng = random.Random(seed)
    aborts = {rng.randrange(5, 60): f"q{rng.randrange(48)}" for _ in range(6)}
    reference = run_random(tiny_engine_factory(max_num_batched_tokens=128), workload, {})
    engine = tiny_engine_factory(max_num_batched_tokens=128, num_kv_blocks=48,
                                 max_num_seqs=16, async_scheduling=True)
    got = run_random(engine, workload, aborts)
    assert engine.scheduler.num_preemptions > 0
    assert any(seq.get("finish") == "abort" for seq in got.values())
    assert_idle(engine)
    aborted = set(aborts.values())
    for key, seq in got.items():
        want = reference[key]
        if key[0] in aborted and seq.get("finish") == "abort":
            assert seq["tokens"] == want["tokens"][:len(seq["tokens"])], key
        else:
            assert seq == want, key
