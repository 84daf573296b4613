"""Request fields kvserve does not support yet but that would change what the caller
gets back: refused with a 400 that names the field, instead of being dropped so
that the caller silently gets plain text (an agent's tool call that never comes, a
JSON schema nobody enforced). A field sent with a value that leaves the output as
it is without it (`"functions": []`, `"function_call": "none"`, `best_of` equal to
`n`) passes, since clients send such defaults. Unknown fields outside these lists
are ignored with a log line, as vLLM does with `user`; the README lists both kinds.
Tools are read by server/tools.py."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.server.errors import APIError

Harmless = Callable[[Any, Any], bool]  # (value, request) -> True if output unchanged


def _empty(value, _req) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


def _no_tool_forced(value, _req) -> bool:
    return value is None or value in ("none", "auto")


def _text_only(value, _req) -> bool:
    return value is None or value == ["text"]


def _true_or_unset(value, _req) -> bool:
    return value is None or value is True


def _best_of_n(value, req) -> bool:
    return value is None or value == req.n


# Both routes: vLLM's sampling extras that kvserve does not implement (structured
# outputs are read by server/structured_fields.py).
_SHARED: dict[str, Harmless] = {
    "truncate_prompt_tokens": _empty, "logits_processors": _empty,
    "logprob_token_ids": _empty, "thinking_token_budget": _empty,
    "repetition_detection": _empty, "return_tokens_as_token_ids": _empty,
    "spaces_between_special_tokens": _true_or_unset,
}
COMPLETION_FIELDS: dict[str, Harmless] = {
    **_SHARED, "best_of": _best_of_n, "suffix": _empty,
}
CHAT_FIELDS: dict[str, Harmless] = {
    "functions": _empty, "function_call": _no_tool_forced,  # OpenAI's older spelling
    **_SHARED,
    "modalities": _text_only, "audio": _empty, "web_search_options": _empty,
    # vLLM's chat extras: the prompt echoed back, BOS added twice, RAG documents
    "echo": _empty, "add_special_tokens": _empty, "documents": _empty,
    "include_reasoning": _true_or_unset,
}


def refuse_unsupported(req, fields: dict[str, Harmless]) -> None:
    """400 for the first field in `fields` (in their order: `functions` before the
    `function_call` that comes with it) that the request sets to a value that would
    change its output."""
    extra = req.model_extra
    if not extra:  # what nearly every request costs
        return
    for name, harmless in fields.items():
        if name in extra and not harmless(extra[name], req):
            raise APIError(400, f"`{name}` is not supported by this server yet, and "
                           "without it the response would not be what the request asks "
                           "for; leave it out", name, "unsupported_parameter")
