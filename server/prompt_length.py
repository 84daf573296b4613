"""A lower bound on how many tokens a text becomes, read from the tokenizer's own
description, so that a prompt which cannot fit the context is refused at the cost
of a scan of the text, without tokenizing it (5 MB of text take seconds).

No token covers more characters of the input than its vocabulary string has: a
byte-level token stands for one byte (a character is one or more), a SentencePiece
piece writes a space as one '▁', a byte-fallback token '<0xE2>' for one byte. So a
text needs at least len(text) / longest tokens, provided nothing deletes input.
What can: normalizers and pre-tokenizers that strip, collapse or drop text; added
tokens that swallow the whitespace around them; a BPE model that drops a character
it has no token for (a byte-level vocabulary missing a byte: SmolLM2's drops the
control character U+0004) or fuses a run of them into one token; the WordPiece,
Unigram and WordLevel models, whose one unknown token stands for a word of any
length. Characters a byte-level BPE drops are not counted; where anything else can
drop input, or the tokenizer says nothing of itself (a slow tokenizer, a custom
Python component), there is no bound and the text is tokenized."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tokenizers.pre_tokenizers import ByteLevel

# Unicode normalization can compose up to four code points into one (U+1FAF is an
# omega and three combining marks); nothing else these normalizers do shortens text.
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_LENGTH_KEEPING_NORMALIZERS = {"Lowercase", "Prepend"}
# Pre-tokenizers that split text without dropping any of it.
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTERS = {"Split", "Punctuation"}  # lossless unless their behaviour is "Removed"


@dataclass(frozen=True)
class TokenBound:
    chars_per_token: int  # the most characters of input one token stands for
    dropped: str = ""  # characters the tokenizer drops: they make no token

    def min_tokens(self, text: str) -> int:
        kept = len(text) - sum(map(text.count, self.dropped))
        return math.ceil(kept / self.chars_per_token)


def token_bound(tokenizer) -> TokenBound | None:
    """How to bound a text's token count from below, or None if it cannot be."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
    except Exception:  # a custom Python component cannot be described
        return None
    if spec is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None  # such a token takes any run of whitespace beside it
    shrink = _normalizer_shrink(spec.get("normalizer"))
    vocab = tokenizer.get_vocab()
    dropped = _dropped_characters(spec.get("model") or {}, vocab,
                                  _has_byte_level(spec.get("pre_tokenizer")))
    if shrink is None or dropped is None:
        return None
    return TokenBound(max(map(len, vocab)) * shrink, dropped)


def _dropped_characters(model: dict, vocab: dict[str, int], byte_level: bool) -> str | None:
    """The characters a BPE model drops for want of a token ("" if none), or None
    where a character it does not know may vanish or merge with others unbounded."""
    if model.get("type") != "BPE":
        return None
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return ""  # an unknown character is spelled in bytes
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return ""  # an unknown character is one unknown token
    if not byte_level:
        return None  # an unknown character is dropped, and it could be any
    missing = {b for b, char in _BYTE_CHARS.items() if char not in vocab}
    if missing & _CONTINUATION_BYTES:
        return None  # whole multi-byte characters may vanish
    # A multi-byte character keeps its continuation bytes; an ASCII one whose byte
    # is missing makes no token at all.
    return "".join(chr(b) for b in sorted(missing) if b < 0x80)


def _byte_level_chars() -> dict[int, str]:
    """Byte -> the character ByteLevel writes it as, for the bytes UTF-8 text has
    (0xC0, 0xC1 and 0xF5-0xFF never occur in it)."""
    def chars(text: str) -> str:
        pieces = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
        return "".join(piece for piece, _ in pieces)

    table = {b: chars(chr(b)) for b in range(0x80)}
    table |= {0x80 + k: chars(chr(0x80 + k))[1] for k in range(64)}  # C2 80+k
    leads = [chr(x << 6) for x in range(2, 32)] + [chr(0x800)]  # C2..DF, E0
    leads += [chr(0x1000 * k) for k in range(1, 16)]  # E1..EF
    leads += [chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000)]  # F0..F4
    for lead in leads:
        table[lead.encode()[0]] = chars(lead)[0]
    return table


_BYTE_CHARS = _byte_level_chars()
_CONTINUATION_BYTES = set(range(0x80, 0xC0))


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(map(_has_byte_level, pre_tokenizer.get("pretokenizers") or ()))
    return pre_tokenizer.get("type") == "ByteLevel"


def _normalizer_shrink(spec: dict | None) -> int | None:
    """By how much the normalizer may shorten a text at most (None: without limit)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in _UNICODE_FORMS:
        return 4
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
