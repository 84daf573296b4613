"""chat_template_kwargs reach the chat template only as the variables it reads (as
vLLM keeps them): never as apply_chat_template's own parameters, never as names the
template does not use."""
from __future__ import annotations

import pytest

from kvserve.server.chat_template import render_chat_text, template_variables

TEMPLATE = ("{% if greeting %}{{ greeting }} {% endif %}{% for m in messages %}"
            "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from kvserve.modelstore.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir("llama"))


def test_the_template_s_own_variables_pass(tok):
    text = render_chat_text(tok, MESSAGES, chat_template=TEMPLATE,
                            chat_template_kwargs={"greeting": "hi"})
    assert text == "hi hello>"


def test_other_names_and_apply_chat_template_s_parameters_do_not(tok, monkeypatch):
    seen = {}
    real = type(tok).apply_chat_template

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(tok), "apply_chat_template", spy)
    text = render_chat_text(tok, MESSAGES, chat_template=TEMPLATE, chat_template_kwargs={
        "greeting": "hi", "tokenize": True, "return_dict": True, "tokenizer_kwargs": {},
        "not_in_the_template": 1})
    assert text == "hi hello>"  # text, not token ids or a dict
    assert seen["tokenize"] is False and "return_dict" not in seen
    assert "tokenizer_kwargs" not in seen and "not_in_the_template" not in seen


def test_variables_are_found_past_transformers_own_tags():
    assert {"greeting", "messages", "add_generation_prompt"} <= template_variables(TEMPLATE)
    assert template_variables("{% if %}") == frozenset()  # unparsable: nothing passes
