"""server/prompt_length.py: the lower bound on a text's token count holds for the
tokenizers it trusts, and it trusts none that can drop input."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from server.errors import APIError
from server.prompt_length import max_chars_per_token, min_tokens
from server.tokenization import Tokenization
from tests.support.tiny_models import make_tokenizer

# Text that stresses the bound: long runs of one character (merged into long
# tokens), whitespace runs, multi-byte and combining characters, Hangul jamo
# (which NFC composes three into one), special-token text.
PIECES = ["a", "aaaa", " ", "    ", "\n", "\t", "é", "e\u0301", "東京", "🙂", "\u1100\u1161\u11a8",
          "<|im_start|>", "<|im_end|>", "The capital of France is Paris.", "0 1 2 3", "\u2028"]
texts = st.lists(st.sampled_from(PIECES), max_size=60).map("".join) | st.text(max_size=200)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _fast(model, normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _assert_bound_holds(tokenizer, bound: int, text: str) -> None:
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= min_tokens(text, bound)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_the_bound_holds_for_a_byte_level_bpe(tiny_tokenizer, text):
    _assert_bound_holds(tiny_tokenizer, 13, text)


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    from engine.loader import load_tokenizer

    return load_tokenizer(str(default_model_dir))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_the_bound_holds_for_the_default_model(default_tokenizer, text):
    _assert_bound_holds(default_tokenizer, 81, text)


@pytest.mark.slow
def test_the_default_models_longest_token_has_81_characters(default_tokenizer):
    assert max_chars_per_token(default_tokenizer) == 81


@settings(max_examples=200, deadline=None)
@given(texts)
def test_the_bound_allows_for_unicode_normalization(tiny_tokenizer, text):
    """Behind an NFC normalizer (Qwen2 has one), three code points may become one
    (Hangul jamo): the bound triples."""
    nfc = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str()))
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    _assert_bound_holds(nfc, 3 * 13, text)


def test_nfc_triples_the_bound(tiny_tokenizer):
    nfc = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str()))
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    assert max_chars_per_token(tiny_tokenizer) == 13
    assert max_chars_per_token(nfc) == 3 * 13


@pytest.mark.parametrize("name, normalizer, pre_tokenizer, model", [
    ("strips whitespace", normalizers.Strip(), None, "bpe"),
    ("strips accents", normalizers.StripAccents(), None, "bpe"),
    ("BERT's cleaning", normalizers.BertNormalizer(), None, "bpe"),
    ("deletes text", normalizers.Replace(" ", ""), None, "bpe"),
    ("splits on whitespace, dropping it", None, pre_tokenizers.Whitespace(), "bpe"),
    ("splits removing the delimiter", None, pre_tokenizers.Split(" ", "removed"), "bpe"),
    ("one token for any unknown run", None, None, "unigram"),
])
def test_no_bound_where_text_can_vanish(name, normalizer, pre_tokenizer, model):
    built = (models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>") if model == "bpe"
             else models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    assert max_chars_per_token(_fast(built, normalizer, pre_tokenizer)) is None, name


def test_no_bound_for_added_tokens_that_swallow_whitespace(tiny_tokenizer, tmp_path):
    from tokenizers import AddedToken

    tiny_tokenizer.save_pretrained(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert max_chars_per_token(tok) == 13
    tok.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert max_chars_per_token(tok) is None


def test_refusal_starts_where_the_text_must_reach_the_context(tiny_tokenizer):
    """At max_model_len 64 (63 prompt tokens at most) and at most 13 characters a
    token: 819 characters may still fit, 820 cannot."""
    tokenization = Tokenization(tiny_tokenizer, max_model_len=64)
    try:
        tokenization.refuse_if_too_long("a" * (63 * 13), "prompt")  # may fit in 63
        with pytest.raises(APIError) as refused:
            tokenization.refuse_if_too_long("a" * (63 * 13 + 1), "prompt")
    finally:
        tokenization.shutdown()
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "at least 64 tokens" in refused.value.message
    assert len(tiny_tokenizer.encode("a" * (63 * 13 + 1))) >= 64
