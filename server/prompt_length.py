"""A lower bound on how many tokens a text becomes, read from the tokenizer's own
description, so that a prompt which cannot fit the context is refused at the cost
of len(text), without tokenizing it (5 MB of text take seconds to tokenize).

No token covers more characters of the input than its vocabulary string has: a
byte-level token stands for one byte (a character is one or more), a SentencePiece
piece writes a space as one '▁', a WordPiece '##' prefix only adds length. So a
text needs at least len(text) / longest tokens, provided nothing before the model
deletes input: normalizers and pre-tokenizers that strip, collapse or drop text,
added tokens that swallow the whitespace around them, or a model that folds a run
of unknown characters into one token. Where the tokenizer does any of that, or says
nothing of itself (a slow tokenizer), there is no bound and the text is tokenized."""
from __future__ import annotations

import json
import math

# Unicode normalization can compose up to three code points into one (Hangul
# jamo L+V+T -> one syllable); nothing else these normalizers do shortens text.
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_LENGTH_KEEPING_NORMALIZERS = {"Lowercase", "Prepend"}
# Pre-tokenizers that split text without dropping any of it.
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTERS = {"Split", "Punctuation"}  # lossless unless their behaviour is "Removed"


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of input one token can stand for, or None if unbounded."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    longest = _longest_token(spec.get("model") or {}, tokenizer)
    if shrink is None or longest is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None  # such a token takes any run of whitespace beside it
    return longest * shrink


def min_tokens(text: str, chars_per_token: int) -> int:
    return math.ceil(len(text) / chars_per_token)


def _longest_token(model: dict, tokenizer) -> int | None:
    kind = model.get("type")
    if kind == "BPE" and not model.get("fuse_unk"):  # an unknown character: one token
        return max(map(len, tokenizer.get_vocab()))
    if kind == "WordPiece":  # a word too long to split becomes one unknown token
        return max(max(map(len, tokenizer.get_vocab())),
                   model.get("max_input_chars_per_word") or 100)
    return None  # Unigram and WordLevel fold unknown runs of any length into one


def _normalizer_shrink(spec: dict | None) -> int | None:
    """By how much the normalizer may shorten a text at most (None: without limit)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in _UNICODE_FORMS:
        return 3
    if kind in _LENGTH_KEEPING_NORMALIZERS:
        return 1
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        before, after = pattern.get("String"), spec.get("content") or ""
        if before is None or not after:  # a regex, or a deletion
            return None
        return max(1, math.ceil(len(before) / len(after)))
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers") or ():
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, ... drop text


def _keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind in _LOSSLESS_PRE_TOKENIZERS:
        return True
    if kind in _SPLITTERS:
        return spec.get("behavior") != "Removed"
    if kind == "Sequence":
        return all(_keeps_text(part) for part in spec.get("pretokenizers") or ())
    return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, ... drop whitespace
