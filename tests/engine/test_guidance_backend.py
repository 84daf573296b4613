"""The llguidance backend (--structured-outputs-backend guidance) behind the same
matcher interface as xgrammar: the same kinds of structured output hold on the
default model at temperature 1, beside free requests and xgrammar's structural
tags; Lark grammars are its own. (Speculative drafts checked by it:
test_structured_outputs.py.)"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.structured.grammars import check
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.structured_output import StructuredOutput
from tests.engine.test_structured_outputs import JSON, REGEX, SCHEMA, run

EBNF = StructuredOutput("grammar", 'root ::= "id-" [0-9] [0-9]? [0-9]? "!"')  # xgrammar's syntax
LARK = StructuredOutput("grammar", 'start: "id-" /[0-9]{1,3}/ "!"')  # llguidance's own
TAG = StructuredOutput("structural_tag", json.dumps({
    "type": "structural_tag", "format": {"type": "tag", "begin": "<n>", "end": "</n>",
                                         "content": {"type": "regex", "pattern": "[0-9]{2}"}}}))


@pytest.fixture(scope="module")
def guided(default_model_dir):
    return Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                               num_kv_blocks=256, structured_outputs_backend="guidance"))


def test_each_kind_holds_beside_free_requests(guided):
    kinds = [JSON, JSON, StructuredOutput("regex", REGEX),
             StructuredOutput("choice", '["yes", "no"]'), EBNF, LARK, TAG, None]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured=s)
              for i, s in enumerate(kinds)]
    texts = run(guided, params)
    for text in texts[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, texts[2])
    assert texts[3] in ("yes", "no")
    for text in texts[4:6]:
        assert re.fullmatch(r"id-[0-9]{1,3}!", text)
    assert re.fullmatch(r"<n>[0-9]{2}</n>", texts[6])
    assert texts[7] == run(guided, [params[7]])[0]  # the free one, seeded, as alone


def test_a_rollback_over_the_end_token_restores_the_state(guided):
    grammar = guided.grammars.compiler.submit(EBNF).result()
    matcher = grammar.matcher()
    tokenizer = guided.tokenizer
    end = next(iter(guided.eos_token_ids))
    for token in tokenizer.encode("id-7!"):
        assert matcher.accept_token(token)
    assert matcher.accept_token(end) and matcher.is_terminated()
    assert not matcher.accept_token(tokenizer.encode("1")[0])  # nothing after the end
    matcher.rollback(2)  # the end and "!"
    assert not matcher.is_terminated()
    assert not matcher.accept_token(end)  # "id-7" is not a whole answer
    assert matcher.accept_token(tokenizer.encode("!")[0]) and matcher.accept_token(end)


@pytest.mark.parametrize("spec", [
    StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": 5}}}'),
    StructuredOutput("regex", "(unclosed"),
    StructuredOutput("grammar", "start: undefined_rule"),
])
def test_specs_it_cannot_serve_are_refused_up_front(spec):
    with pytest.raises(ValueError, match="invalid"):
        check(spec, "guidance")


def test_lark_is_the_guidance_backends_own():
    check(LARK, "guidance")
    with pytest.raises(ValueError):
        check(LARK, "xgrammar")
    check(EBNF, "guidance")  # and xgrammar's EBNF is read by both
    check(EBNF, "xgrammar")


def test_greedy_json_is_the_same_as_under_xgrammar(guided, default_model_dir):
    """Both backends write JSON alike (no free whitespace, ", " and ": ")."""
    xgrammar = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                                   num_kv_blocks=64))
    greedy = [SamplingParams(max_tokens=60, temperature=0.0, structured=JSON)]
    assert run(guided, greedy) == run(xgrammar, greedy)
