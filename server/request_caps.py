"""The caps on how many of a thing one request may carry (sequences, stop strings,
logit_bias entries, bad words, tools), in one place, checked on whatever thread holds the
request: the service's, on the loop, for every request; and the JSON reader's for a
big body (server/json_body.py), so that a refused request's objects are freed on
that thread (freeing 20,000 tool definitions takes 14-27 ms) and the loop never sees
them. Each is a 400 naming its field."""
from __future__ import annotations

from kvserve.server.config import ServerConfig
from kvserve.server.detokenizer import MAX_STOP_CHARS
from kvserve.server.errors import APIError
from kvserve.server.grammar_limits import GrammarLimits

# vLLM's bad_words: each word is tokenized twice, on the tokenizer's thread; a step
# compares with the output's tail only the sequences whose prefix ends with the
# output's last token (at worst all 2 x 128 of them, each as long as a 256-character
# word tokenizes to).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


def refuse_past_counts(req, config: ServerConfig) -> None:
    """400 past --max-n, --max-stop-strings (or MAX_STOP_CHARS in one), --max-logit-bias,
    MAX_BAD_WORDS (or MAX_BAD_WORD_CHARS in one) or --max-tools, for whichever of
    those fields the request model has."""
    n = getattr(req, "n", None)
    if isinstance(n, int) and n > config.max_n:
        raise APIError(400, f"n must be at most {config.max_n} (--max-n), got {n}", "n")
    if hasattr(req, "stop_strings"):
        _check_stop(req.stop_strings(), config.max_stop_strings)
    bias = getattr(req, "logit_bias", None) or ()
    if config.max_logit_bias and len(bias) > config.max_logit_bias:
        raise APIError(400, f"at most {config.max_logit_bias} logit_bias entries "
                       f"(--max-logit-bias), got {len(bias)}", "logit_bias")
    words = getattr(req, "bad_words", None)
    if isinstance(words, list):
        _check_bad_words(words)
    tools = getattr(req, "tools", None) or (req.model_extra or {}).get("tools")
    if isinstance(tools, list):
        GrammarLimits.of(config).check_tool_count(tools)


def _check_stop(stops: list[str], most: int) -> None:
    """Each token's text is searched for them all on the event loop."""
    if len(stops) > most:
        raise APIError(400, f"at most {most} stop strings (--max-stop-strings), got "
                       f"{len(stops)}", "stop")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters, "
                       f"got one of {longest}", "stop")


def _check_bad_words(words: list) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise APIError(400, f"at most {MAX_BAD_WORDS} bad_words, got {len(words)}",
                       "bad_words")
    longest = max((len(w) for w in words if isinstance(w, str)), default=0)
    if longest > MAX_BAD_WORD_CHARS:
        raise APIError(400, f"a bad word may have at most {MAX_BAD_WORD_CHARS} characters, "
                       f"got one of {longest}", "bad_words")
