"""Request checks that need the engine (context length, vocabulary) or the served
model names; each failure is an APIError with OpenAI's status and wording."""
from __future__ import annotations

from collections.abc import Mapping

from kvserve.engine.client.engine_client import EngineClient
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.structured_output import StructuredOutput
from kvserve.server.errors import APIError, no_tokenizer
from kvserve.server.protocol import SamplingFields


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


def sampling_params(req: SamplingFields, max_tokens: int, vocab_size: int,
                    logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    tool_grammar: StructuredOutput | None = None,
                    structured: StructuredOutput | None = None,
                    has_tokenizer: bool = True) -> SamplingParams:
    """tool_grammar: what the request's tool calling makes the output (server/tools.py);
    structured: its structured output, already read and checked off the event loop
    (server/structured_fields.py)."""
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
            speculative=req.speculative, structured=structured or tool_grammar)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


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
