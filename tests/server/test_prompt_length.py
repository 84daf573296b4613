"""server/prompt_length.py: the lower bound on a text's token count holds for every
tokenizer it gives one for, checked against real tokenization on texts built to
stress it, and it gives none where text can vanish."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvserve.server.errors import APIError
from kvserve.server.prompt_length import TokenBound, token_bound
from kvserve.server.tokenization import Tokenization
from tests.support.tiny_models import make_tokenizer

# Text that stresses the bound: long runs of one character (merged into long
# tokens), whitespace runs, multi-byte and combining characters, Hangul jamo and an
# omega with three marks (which NFC composes into one), special-token text, and
# control characters (some byte-level vocabularies have no token for them).
PIECES = ["a", "aaaa", " ", "    ", "\n", "\t", "é", "e\u0301", "東京", "🙂", "\u1100\u1161\u11a8",
          "\u03a9\u0314\u0342\u0345", "<|im_start|>", "<|im_end|>", "0 1 2 3", "\u2028",
          "The capital of France is Paris.", "\x04", "\x13\x14", "\U00040000"]
texts = st.lists(st.sampled_from(PIECES), max_size=60).map("".join) | st.text(max_size=200)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    from kvserve.modelstore.tokenizer import load_tokenizer

    return load_tokenizer(str(default_model_dir))


def _fast(model, normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _with_nfc(tokenizer) -> PreTrainedTokenizerFast:
    nfc = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()))
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    return nfc


def _assert_bound_holds(tokenizer, bound: TokenBound, text: str) -> None:
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= bound.min_tokens(text)


@settings(max_examples=300, deadline=None)
@given(texts)
def test_the_bound_holds_for_a_byte_level_bpe(tiny_tokenizer, text):
    _assert_bound_holds(tiny_tokenizer, TokenBound(13), text)


def test_the_tiny_tokenizer_has_every_byte(tiny_tokenizer):
    assert token_bound(tiny_tokenizer) == TokenBound(13)


@pytest.fixture(scope="module")
def default_bound(default_tokenizer):
    return token_bound(default_tokenizer)  # reads the whole vocabulary: once


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(texts)
def test_the_bound_holds_for_the_default_model(default_tokenizer, default_bound, text):
    _assert_bound_holds(default_tokenizer, default_bound, text)


@pytest.mark.slow
def test_the_default_model_drops_some_control_characters(default_tokenizer, default_bound):
    """SmolLM2's longest token has 81 characters, and its vocabulary has no byte for
    a few control characters: those make no token, so they count for nothing."""
    bound = default_bound
    assert bound.chars_per_token == 81
    assert "\x04" in bound.dropped and "a" not in bound.dropped
    assert default_tokenizer.encode("\x04" * 1000, add_special_tokens=False) == []
    assert bound.min_tokens("\x04" * 1000) == 0


@settings(max_examples=200, deadline=None)
@given(texts)
def test_the_bound_allows_for_unicode_normalization(tiny_tokenizer, text):
    """Behind an NFC normalizer (Qwen2 has one), up to four code points become one
    (U+1FAF): the bound is four times as long."""
    _assert_bound_holds(_with_nfc(tiny_tokenizer), TokenBound(4 * 13), text)


def test_nfc_quadruples_the_bound(tiny_tokenizer):
    assert token_bound(_with_nfc(tiny_tokenizer)) == TokenBound(4 * 13)


def _sentencepiece_like(**bpe) -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral's shape: Metaspace, BPE pieces, unknown characters handled
    per `bpe` (byte fallback, or one unknown token each)."""
    vocab = {p: i for i, p in enumerate(["<unk>", "\u2581", "\u2581t", "\u2581th", "\u2581the",
                                         "\u2581capital", "a", "e", "h", "t"])}
    if bpe.get("byte_fallback"):
        vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e")]
    return _fast(models.BPE(vocab, merges, **bpe), None, pre_tokenizers.Metaspace())


SENTENCEPIECE_LIKE = [dict(byte_fallback=True, unk_token="<unk>", fuse_unk=True),
                      dict(unk_token="<unk>")]


@settings(max_examples=200, deadline=None)
@given(texts)
def test_the_bound_holds_for_sentencepiece_style_bpe(text):
    for bpe in SENTENCEPIECE_LIKE:
        tokenizer = _sentencepiece_like(**bpe)
        _assert_bound_holds(tokenizer, token_bound(tokenizer), text)


@pytest.mark.parametrize("bpe", SENTENCEPIECE_LIKE)
def test_sentencepiece_style_bpe_has_a_bound(bpe):
    assert token_bound(_sentencepiece_like(**bpe)) == TokenBound(8)  # "▁capital"


VOCAB = {"a": 0, "<unk>": 1}
MODELS = {"bpe": lambda: models.BPE(VOCAB, [], unk_token="<unk>"),
          "bpe-no-unk": lambda: models.BPE(VOCAB, []),
          "bpe-fused": lambda: models.BPE(VOCAB, [], unk_token="<unk>", fuse_unk=True),
          "wordpiece": lambda: models.WordPiece(VOCAB, unk_token="<unk>"),
          "unigram": lambda: models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0)}


@pytest.mark.parametrize("name, normalizer, pre_tokenizer, model", [
    ("strips whitespace", normalizers.Strip(), None, "bpe"),
    ("strips accents", normalizers.StripAccents(), None, "bpe"),
    ("BERT's cleaning", normalizers.BertNormalizer(), None, "bpe"),
    ("deletes text", normalizers.Replace(" ", ""), None, "bpe"),
    ("splits on whitespace, dropping it", None, pre_tokenizers.Whitespace(), "bpe"),
    ("splits removing the delimiter", None, pre_tokenizers.Split(" ", "removed"), "bpe"),
    ("drops characters it does not know", None, pre_tokenizers.Metaspace(), "bpe-no-unk"),
    ("byte-level without continuation bytes", None, pre_tokenizers.ByteLevel(), "bpe-no-unk"),
    ("one token for a run of unknown characters", None, None, "bpe-fused"),
    ("one unknown token for any word too long", None, pre_tokenizers.Metaspace(), "wordpiece"),
    ("one token for any unknown run", None, None, "unigram"),
])
def test_no_bound_where_text_can_vanish(name, normalizer, pre_tokenizer, model):
    assert token_bound(_fast(MODELS[model](), normalizer, pre_tokenizer)) is None, name


def test_those_tokenizers_do_lose_text():
    """What the refusals above guard against, shown on two of them."""
    dropping = _fast(models.BPE({"a": 0}, []), None, pre_tokenizers.Metaspace())
    assert len(dropping.encode("a" + "\u00e9" * 5000, add_special_tokens=False)) <= 2
    wordpiece = _fast(MODELS["wordpiece"](), None, pre_tokenizers.Metaspace())
    assert len(wordpiece.encode("b" * 5000, add_special_tokens=False)) == 1


def test_no_bound_for_added_tokens_that_swallow_whitespace(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert token_bound(tok) == TokenBound(13)
    tok.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert token_bound(tok) is None


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
