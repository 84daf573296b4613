"""Grammar-constrained decoding in the engine (xgrammar), on the default model at
temperature 1, where an unconstrained model would not produce these formats."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.structured.matchers import DEAD_END
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.structured_output import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "colour"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "colour": {"enum": ["red", "green", "blue"]}}}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
REGEX = r"\d{3}-[a-z]{2,4}"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                               num_kv_blocks=256))


def run(engine, params, prompt="Describe a person as JSON:"):
    ids = engine.tokenizer.encode(prompt)
    outs = engine.generate([ids] * len(params), params)
    return [engine.tokenizer.decode(o, skip_special_tokens=True) for o in outs]


def test_constrained_and_free_requests_share_a_batch_and_keep_their_own(engine):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=JSON)
              for i in range(4)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=9,
                              structured=StructuredOutput("regex", REGEX)),
               SamplingParams(max_tokens=10, temperature=1.0,
                              structured=StructuredOutput("choice", '["yes", "no"]')),
               SamplingParams(max_tokens=20, temperature=1.0, seed=3)]
    texts = run(engine, params)
    for text in texts[:4]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, texts[4])
    assert texts[5] in ("yes", "no")
    # the free request is not held to any of them (seeded: the same text alone)
    assert texts[6] == run(engine, [params[6]])[0]
    assert not texts[6].lstrip().startswith("{")


def test_greedy_constrained_output_equals_the_same_request_alone(engine):
    greedy = SamplingParams(max_tokens=60, temperature=0.0, structured=JSON)
    crowd = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(5)]
    alone = run(engine, [greedy])[0]
    assert run(engine, [*crowd, greedy])[-1] == alone
    jsonschema.validate(json.loads(alone), SCHEMA)


def test_forked_sequences_each_follow_the_grammar(engine):
    params = SamplingParams(max_tokens=60, temperature=1.0, n=4, seed=1, structured=JSON)
    texts = run(engine, [params])
    assert len(texts) == 4 and len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_preempted_requests_keep_their_grammar(default_model_dir):
    small = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                num_kv_blocks=16, max_num_batched_tokens=64))
    long_words = StructuredOutput("regex", "[a-z]{5}( [a-z]{5}){25}")
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=s)
              for i, s in enumerate([JSON, long_words] * 3)]
    # 6 x (~45 prompt + 20 to 60 output) tokens against a cache of 256
    texts = run(small, params, "Describe a person as JSON, with a name, an age and a "
                "favourite colour, for a form that a web shop keeps about its customers:")
    assert small.scheduler.num_preemptions > 0
    for text in texts[::2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in texts[1::2]:
        assert re.fullmatch(long_words.spec, text)


def test_a_grammar_that_ends_fails_only_its_request(engine):
    ids = engine.tokenizer.encode("hi")
    engine.add_request("done", ids, SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True,
        structured=StructuredOutput("regex", "ab")))
    engine.add_request("free", ids, SamplingParams(max_tokens=10, temperature=0.0))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["done"][-1].finish_reason == "error" and outs["done"][-1].error == DEAD_END
    assert outs["free"][-1].finish_reason == "length"


def test_a_grammar_that_does_not_compile_ends_its_request_and_an_abort_ends_a_held_one(engine):
    ids = engine.tokenizer.encode("hi")
    engine.add_request("bad", ids, SamplingParams(
        max_tokens=5, structured=StructuredOutput("grammar", "root ::= ")))
    engine.add_request("held", ids, SamplingParams(
        max_tokens=5, structured=StructuredOutput("regex", "[a-z]{3}")))
    aborted = engine.abort_request("held")
    assert [o.finish_reason for o in aborted] == ["abort"]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error")]
    assert "invalid grammar" in outs[0].error


def test_a_matcher_that_raises_fails_only_its_request(engine, monkeypatch):
    """A fault in one request's grammar state is that request's: fault isolation
    probes each request alone (with the grammars, never advancing them)."""
    from kvserve.engine.structured.matchers import Matchers

    class Broken:
        def is_terminated(self):
            return False

        def fill_next_token_bitmask(self, bitmask, row):
            raise RuntimeError("broken matcher")

    own = Matchers._matcher
    monkeypatch.setattr(Matchers, "_matcher", lambda self, seq: Broken()
                        if seq.request_id == "bad" else own(self, seq))
    ids = engine.tokenizer.encode("hi")
    for rid in ("bad", "good"):
        engine.add_request(rid, ids, SamplingParams(
            max_tokens=8, temperature=0.0, structured=StructuredOutput("regex", "[a-z]{3}")))
    engine.add_request("free", ids, SamplingParams(max_tokens=4, temperature=0.0))
    ends, tokens = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ends[o.request_id] = o
    assert ends["bad"].finish_reason == "error" and "broken matcher" in ends["bad"].error
    assert ends["good"].finish_reason == "stop" and ends["free"].finish_reason == "length"
    text = engine.tokenizer.decode(tokens["good"], skip_special_tokens=True)
    assert re.fullmatch("[a-z]{3}", text)


EXAMPLE = ('Describe a person as JSON, like {"name": "Ann", "age": 31, "colour": "red"} '
           'or {"name": "Bob", "age": 42, "colour": "blue"}:')


@pytest.mark.parametrize("method, backend", [("ngram", "xgrammar"), ("early-exit", "xgrammar"),
                                             ("ngram", "guidance")])
def test_speculative_drafts_are_checked_against_the_grammar(default_model_dir, method,
                                                            backend, monkeypatch):
    """Drafts (copied from the prompt, or the model's first layers' guesses, which
    know no grammar) are cut before the first token the grammar refuses and verified
    on masked rows; the matcher rolls back. Greedy output is the same as without
    speculation, sampled output is valid, and drafts were accepted."""
    from kvserve.engine.config.engine_config import SpeculativeConfig
    from kvserve.engine.structured.matchers import Matchers

    walks = []  # (drafts, kept) of each constrained verification
    walk = Matchers._walk
    monkeypatch.setattr(Matchers, "_walk", staticmethod(
        lambda m, drafts, *a: walks.append((len(drafts), walk(m, drafts, *a))) or walks[-1][1]))
    spec = Engine(EngineConfig(
        model=str(default_model_dir), dtype="float32", num_kv_blocks=256,
        structured_outputs_backend=backend,
        speculative=SpeculativeConfig(method, num_tokens=4, ngram_min=1, draft_layers=8)))
    greedy = SamplingParams(max_tokens=60, temperature=0.0, structured=JSON)
    plain = SamplingParams(max_tokens=60, temperature=0.0, structured=JSON, speculative=False)
    assert run(spec, [greedy], EXAMPLE) == run(spec, [plain], EXAMPLE)
    sampled = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=JSON)
               for i in range(4)]
    for text in run(spec, sampled, EXAMPLE):
        jsonschema.validate(json.loads(text), SCHEMA)
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert any(kept < n for n, kept in walks) and any(kept == n > 0 for n, kept in walks)


def test_a_prefix_hit_gives_the_same_constrained_output(engine):
    """The second request finds the first's prompt blocks cached: its grammar starts
    at its own first output token all the same."""
    ids = engine.tokenizer.encode("Three times over. " + EXAMPLE * 3)  # cached by no other test
    greedy = SamplingParams(max_tokens=40, temperature=0.0, structured=JSON)
    texts, cached = [], []
    for rid in ("first", "second"):
        engine.add_request(rid, ids, greedy)
        tokens = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += o.new_token_ids
                if o.finished:
                    cached.append(o.num_cached_tokens)
        texts.append(engine.tokenizer.decode(tokens, skip_special_tokens=True))
    assert cached[0] == 0 and cached[1] >= len(ids) // 2
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[1]), SCHEMA)


def test_async_scheduling_overlaps_constrained_steps_with_the_same_output(
        engine, default_model_dir):
    """Under async scheduling a step with constrained rows no longer waits for the
    one before it to be read: its masks take that step's tokens when it samples,
    after its forward pass. Outputs (greedy, seeded, ending on the grammar's end
    token or on max_tokens) are those of the synchronous engine, and steps with
    constrained rows were fed tokens from the step before them."""
    from tests.engine.test_async_scheduling import record_schedules

    overlapped = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                     num_kv_blocks=256, async_scheduling=True))
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured=JSON),
              SamplingParams(max_tokens=60, temperature=1.0, seed=4, structured=JSON),
              SamplingParams(max_tokens=20, temperature=1.0, seed=9,
                             structured=StructuredOutput("regex", REGEX)),
              SamplingParams(max_tokens=6, temperature=1.0, seed=2, structured=JSON),
              SamplingParams(max_tokens=25, temperature=1.0, seed=3)]
    outs = record_schedules(overlapped)
    assert run(overlapped, params) == run(engine, params)
    fed = {s.request.params.structured is not None
           for o in outs for s in o.scheduled if s.num_pending}
    assert True in fed
