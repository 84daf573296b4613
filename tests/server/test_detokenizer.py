"""IncrementalDetokenizer: token-by-token decoding and stop strings, with the tiny
model's byte-level BPE tokenizer (multi-byte characters are split across tokens)."""
from __future__ import annotations

import pytest

from kvserve.server.detokenizer import IncrementalDetokenizer

MULTIBYTE_TEXTS = [
    "Héllo wörld",
    "東京",
    "🙂",
    "naïve café, 東京 and emoji 🙂!",
    "The capital of France is Paris. 東京 🙂🙂 é",
    "def add(a, b):\n    return a + b\n",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel tokenizers use."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from kvserve.modelstore.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def byte_ids(tok):
    """text -> one token per UTF-8 byte (the worst case for a detokenizer)."""
    b2u = _bytes_to_unicode()

    def encode(text: str) -> list[int]:
        ids = [tok.convert_tokens_to_ids(b2u[b]) for b in text.encode("utf-8")]
        assert tok.unk_token_id not in ids
        return ids

    return encode


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed one token at a time; the pieces flushed, the final flush last."""
    pieces = []
    for t in ids:
        detok.add_tokens([t])
        pieces.append(detok.flush(False))
        if detok.stop_reason is not None:
            break
    pieces.append(detok.flush(True))
    return pieces


def test_byte_encoder_round_trips(tok, byte_ids):
    for text in MULTIBYTE_TEXTS:
        assert tok.decode(byte_ids(text)) == text


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_streaming_equals_full_decode(tok, byte_ids, text, split):
    ids = tok.encode(text) if split == "bpe" else byte_ids(text)
    if split == "bpe" and any(ord(c) > 127 for c in text):
        # make sure the test really exercises characters split over tokens
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = stream(IncrementalDetokenizer(tok, []), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    # no piece may hold half a character
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_streaming_with_prompt_context(tok, byte_ids, text):
    prompt = tok.encode("Continuous batching keeps 東京")
    ids = byte_ids(text)
    pieces = stream(IncrementalDetokenizer(tok, prompt), ids)
    assert "".join(pieces) == text


def test_add_tokens_in_chunks_equals_one_by_one(tok, byte_ids):
    text = MULTIBYTE_TEXTS[3]
    ids = byte_ids(text)
    for size in (2, 3, 5, 100):
        d = IncrementalDetokenizer(tok, [])
        out = ""
        for i in range(0, len(ids), size):
            d.add_tokens(ids[i:i + size])
            out += d.flush(False)
        out += d.flush(True)
        assert out == text, size


def test_incomplete_character_at_the_end_is_released(tok, byte_ids):
    ids = byte_ids("ab東")[:-1]  # the last character lacks its final byte
    pieces = stream(IncrementalDetokenizer(tok, []), ids)
    assert "".join(pieces) == tok.decode(ids)
    assert "".join(pieces).startswith("ab")


def test_stop_string_split_across_tokens_is_cut(tok, byte_ids):
    ids = byte_ids("Hello STOP world and more")
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    pieces = stream(d, ids)
    assert d.stop_reason == "STOP"
    assert "".join(pieces) == "Hello "


def test_stop_string_with_bpe_tokens(tok):
    text = "Hello STOP world"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=["OP w"])
    assert "".join(stream(d, ids)) == "Hello ST"
    assert d.stop_reason == "OP w"


@pytest.mark.parametrize("stop", ["STOP", "東京", "🙂!", "x y z"])
def test_hold_back_never_emits_part_of_a_stop_string(tok, byte_ids, stop):
    before = "naïve STAR ST 東 🙂 x y "  # contains false starts of each stop string
    ids = byte_ids(before + stop + " tail")
    d = IncrementalDetokenizer(tok, [], stop=[stop])
    sent = ""
    for t in ids:
        d.add_tokens([t])
        sent += d.flush(False)
        # everything handed out so far is final text before the stop string
        assert before.startswith(sent), (sent, stop)
        if d.stop_reason is not None:
            break
    sent += d.flush(True)
    assert sent == before
    assert d.stop_reason == stop
    assert d.flush(True) == ""  # nothing after the stop


def test_false_start_of_stop_string_is_released(tok, byte_ids):
    text = "STAR STO STOOP done"
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    pieces = stream(d, byte_ids(text))
    assert d.stop_reason is None
    assert "".join(pieces) == text


def test_include_stop_str_in_output(tok, byte_ids):
    d = IncrementalDetokenizer(tok, [], stop=["東京"], include_stop_str_in_output=True)
    pieces = stream(d, byte_ids("go to 東京 by train"))
    assert "".join(pieces) == "go to 東京"
    assert d.stop_reason == "東京"


def test_earliest_of_several_stop_strings_wins(tok, byte_ids):
    text = "alpha beta gamma delta"
    # in one add_tokens call: "beta", "gamma" and "delta" all appear; the earliest wins
    d = IncrementalDetokenizer(tok, [], stop=["delta", "beta", "gamma"])
    d.add_tokens(byte_ids(text))
    assert d.stop_reason == "beta"
    assert d.flush(True) == "alpha "
    # one token at a time
    d = IncrementalDetokenizer(tok, [], stop=["delta", "beta", "gamma"])
    assert "".join(stream(d, byte_ids(text))) == "alpha "
    assert d.stop_reason == "beta"


def test_stop_string_completed_first_wins(tok, byte_ids):
    # "c" is complete as soon as "abc" has arrived, before "cde" could be
    d = IncrementalDetokenizer(tok, [], stop=["cde", "bcdx", "c"])
    d.add_tokens(byte_ids("abcdefg"))
    assert d.stop_reason == "c"
    assert d.flush(True) == "ab"


def test_earliest_stop_string_within_one_token(tok):
    # the single token " capital" completes all three stop strings at once: the one
    # that starts earliest in the text wins, whatever the order of the list
    ids = tok.encode("The capital")
    assert tok.decode(ids[-1:]) == " capital"
    d = IncrementalDetokenizer(tok, [], stop=["tal", "pit", " cap"])
    d.add_tokens(ids)
    assert d.stop_reason == " cap"
    assert d.flush(True) == "The"


def test_no_stop_strings_means_no_hold_back(tok, byte_ids):
    d = IncrementalDetokenizer(tok, [])
    d.add_tokens(byte_ids("abc"))
    assert d.flush(False) == "abc"


def test_special_tokens_are_skipped_or_kept(tok):
    ids = tok.encode("Hello") + [tok.eos_token_id] + tok.encode(" world")
    d = IncrementalDetokenizer(tok, [])
    assert "".join(stream(d, ids)) == tok.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    out = "".join(stream(d, ids))
    assert out == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in out


@pytest.mark.slow
def test_default_model_tokenizer_streaming(default_model_dir):
    from kvserve.modelstore.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    for text in MULTIBYTE_TEXTS + ["Ünïcödé ½ → ∞, 日本語のテキスト, 한국어, 🙂👍🏽🇫🇷"]:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = stream(IncrementalDetokenizer(tok, tok.encode("Say:")), ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
    ids = tok.encode("The capital of France is Paris. 東京 is in Japan.",
                     add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["京 is"])
    assert "".join(stream(d, ids)) == "The capital of France is Paris. 東"
    assert d.stop_reason == "京 is"


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The reference: the earliest occurrence of any stop, the first listed on a tie."""
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    return min(found)[::2] if found else None


@pytest.mark.parametrize("seed", range(8))
def test_one_pattern_finds_the_stop_each_alone_would(tok, byte_ids, seed):
    """All stops in one compiled pattern (up to --max-stop-strings of them, regex
    characters included) cut where the earliest of them, searched for one by one,
    would."""
    import random

    rng = random.Random(seed)
    alphabet = "ab.*(|)"
    text = "".join(rng.choice(alphabet) for _ in range(120))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7)))
             for _ in range(64)]
    want = _first_stop(text, stops)
    d = IncrementalDetokenizer(tok, [], stop=stops)
    out = "".join(stream(d, byte_ids(text)))
    if want is None:
        assert d.stop_reason is None and out == text
    else:
        assert (d.stop_reason, out) == (want[1], text[:want[0]])
