"""Request checks that need the engine (context length, vocabulary) or the served
model names; each failure is an APIError with OpenAI's status and wording."""
from __future__ import annotations

from collections.abc import Mapping

from kvserve.engine.client.engine_client import EngineClient
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.structured_output import StructuredOutput
from kvserve.server.errors import APIError, no_tokenizer
from kvserve.server.protocol import MAX_LOGPROBS, SamplingFields


def check_model(requested: str | None, names: list[str], adapters: Mapping[str, str] = {}
                ) -> str:
    """The served name a request's `model` asks for: a name of the base model (None:
    the first) or a LoRA adapter's."""
    if requested is None:
        return names[0]
    if requested not in names and requested not in adapters:
        raise APIError(404, f"The model `{requested}` does not exist.", "model",
                       "model_not_found")
    return requested


def lora_of(engine: EngineClient, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names, None for the base model."""
    return model if model is not None and model in engine.adapters.served else None


def check_prompt(engine: EngineClient, ids: list[int], param: str = "prompt") -> list[int]:
    """The engine's own checks (empty, too long, ids outside the vocabulary), as a
    400 naming `param`: done here, before any response starts."""
    try:
        engine.validate(ids)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from exc
    return ids


def prompt_token_ids(engine: EngineClient, prompt: str | list[int],
                     param: str = "prompt") -> list[int]:
    if isinstance(prompt, str) and engine.tokenizer is None:
        raise no_tokenizer(param)
    ids = (encode_text(engine.tokenizer, prompt, param) if isinstance(prompt, str)
           else list(prompt))
    return check_prompt(engine, ids, param)


def encode_text(tokenizer, text: str, param: str = "prompt", **kw) -> list[int]:
    """tokenizer.encode, but text it cannot take (JSON may carry a lone surrogate
    such as "\\ud800", which is no UTF-8) is the client's 400, not our 500."""
    try:
        return tokenizer.encode(text, **kw)
    except (TypeError, ValueError, UnicodeError) as exc:
        raise APIError(400, f"{param}: text the tokenizer cannot encode "
                       f"({type(exc).__name__})", param) from exc


def bad_words_token_ids(tokenizer, words: list[str] | None) -> list[list[int]] | None:
    """vLLM's reading of `bad_words` (its SamplingParams.update_from_tokenizer): each
    word, leading whitespace dropped, tokenized without special tokens, and again
    after a space when that gives as many tokens with another first one (the word
    met mid-text); the engine bans each sequence. On the tokenizer's thread."""
    if not words:
        return None
    if tokenizer is None:
        raise no_tokenizer("bad_words")
    out: list[list[int]] = []
    for word in words:
        word = word.lstrip()
        plain = encode_text(tokenizer, word, "bad_words", add_special_tokens=False) \
            if word else []
        if not plain:
            raise APIError(400, "bad_words: each word needs text besides whitespace",
                           "bad_words")
        out.append(plain)
        spaced = encode_text(tokenizer, " " + word, "bad_words", add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def output_budget(max_tokens: int | None, prompt_len: int, max_model_len: int,
                  param: str = "max_tokens") -> int:
    """max_tokens, or all the room the context leaves; 400 (vLLM's words) if too many."""
    room = max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of "
            "the prompt or completion.", param)
    return max_tokens or room


def prompt_logprobs_k(req, vocab_size: int) -> int | None:
    """vLLM's prompt_logprobs as the top k per prompt token the engine computes, held
    to the cap logprobs and top_logprobs have (MAX_LOGPROBS per token), so -1, the
    whole vocabulary, passes only for a vocabulary that small. Not with stream, as in
    vLLM (its words): its stream chunks have no place for them."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if req.stream:
        raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.",
                       "prompt_logprobs")
    if k == -1 and vocab_size > MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs=-1 asks for the whole vocabulary "
                       f"({vocab_size} tokens) at every prompt position; this server "
                       f"returns at most {MAX_LOGPROBS} per token", "prompt_logprobs")
    if k == -1:
        return vocab_size
    if not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be -1 (the whole vocabulary) or "
                       f"between 0 and {MAX_LOGPROBS}, got {k}", "prompt_logprobs")
    return k


def sampling_params(req: SamplingFields, max_tokens: int, vocab_size: int,
                    logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    tool_grammar: StructuredOutput | None = None,
                    structured: StructuredOutput | None = None,
                    has_tokenizer: bool = True,
                    bad_words: list[list[int]] | None = None) -> SamplingParams:
    """tool_grammar: what the request's tool calling makes the output (server/tools.py);
    structured: its structured output, already read and checked off the event loop
    (server/structured_fields.py); bad_words: the request's, tokenized off the event
    loop (bad_words_token_ids)."""
    _check_cross_fields(req, max_tokens)
    if structured is not None and not has_tokenizer:
        raise APIError(400, "structured outputs need the model's tokenizer, and this "
                       "model is served without one", "response_format")
    if structured is not None and tool_grammar is not None:
        raise APIError(400, "a structured output (response_format, structured_outputs, "
                       "guided_*) and tool calls cannot be asked for together",
                       "tool_choice")
    bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
    bad = next((t for t in [*bias, *(req.stop_token_ids or ())] if t >= vocab_size), None)
    if bad is not None:
        param = "logit_bias" if bad in bias else "stop_token_ids"
        raise APIError(400, f"token id {bad} is out of the vocabulary (0..{vocab_size - 1})",
                       param)
    allowed = _allowed_token_ids(req.allowed_token_ids, vocab_size)
    bad = next((t for ids in bad_words or () for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:  # a tokenizer with more tokens than the model
        raise APIError(400, f"bad_words: token id {bad} is out of the model's vocabulary "
                       f"(0..{vocab_size - 1})", "bad_words")
    if allowed is not None and bad_words and \
            {ids[0] for ids in bad_words if len(ids) == 1}.issuperset(allowed):
        raise APIError(400, "bad_words ban every token of allowed_token_ids: nothing could "
                       "be generated", "allowed_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens, n=req.n,
            temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
            top_k=req.top_k or 0, min_p=_or(req.min_p, 0.0), seed=req.seed,
            ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
            min_tokens=req.min_tokens,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            logit_bias=bias or None, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            speculative=req.speculative, structured=structured or tool_grammar,
            allowed_token_ids=allowed, bad_words_token_ids=bad_words,
            kv_transfer_params=req.kv_transfer_params and req.kv_transfer_params.model_dump())
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def _allowed_token_ids(ids: list[int] | None, vocab_size: int) -> list[int] | None:
    """vLLM's checks: not empty, every id in the vocabulary. At most vocab_size ids
    (what a set can hold), so the most one request costs is a list of one vocabulary
    (parsed by pydantic, then a few passes over it here, in SamplingParams and in
    the engine's checks: milliseconds at 150k ids), and one vocabulary of bools on
    the device, built once and kept while it runs (engine/sampling/adjustments.py);
    per step, its row is masked with it."""
    if ids is None:
        return None
    if not ids:
        raise APIError(400, "allowed_token_ids must not be empty (leave it out to allow "
                       "every token)", "allowed_token_ids")
    if len(ids) > vocab_size:
        raise APIError(400, f"allowed_token_ids may list at most {vocab_size} ids (the "
                       f"vocabulary's size), got {len(ids)}", "allowed_token_ids")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise APIError(400, f"allowed_token_ids: token id {bad} is out of the vocabulary "
                       f"(0..{vocab_size - 1})", "allowed_token_ids")
    return ids


def _check_cross_fields(req: SamplingFields, max_tokens: int) -> None:
    """vLLM's checks across fields, each a 400 naming the field."""
    if req.stream_options is not None and req.stream_options.model_fields_set \
            and not req.stream:
        raise APIError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens must be less than or equal to max_tokens="
                       f"{max_tokens}, got {req.min_tokens}.", "min_tokens")


def _or(value, default):
    return default if value is None else value
