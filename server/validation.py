"""Request checks that need the engine (context length, vocabulary) or the served
model names; each failure is an APIError with OpenAI's status and wording."""
from __future__ import annotations

from engine.async_engine import AsyncEngine
from scheduler.sampling_params import SamplingParams
from server.errors import APIError
from server.protocol import CompletionRequest


def check_model(requested: str | None, names: list[str]) -> str:
    if requested is None:
        return names[0]
    if requested not in names:
        raise APIError(404, f"The model `{requested}` does not exist.", "model",
                       "model_not_found")
    return requested


def prompt_token_ids(engine: AsyncEngine, prompt: str | list[int]) -> list[int]:
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", "prompt")
    try:
        engine.validate(ids)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from exc
    return ids


def sampling_params(req: CompletionRequest, prompt_len: int,
                    max_model_len: int) -> SamplingParams:
    room = max_model_len - prompt_len
    if req.max_tokens is not None and req.max_tokens > room:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {prompt_len + req.max_tokens} tokens ({prompt_len} in the "
            f"prompt, {req.max_tokens} in the completion). Please reduce the length of "
            "the prompt or completion.", "max_tokens")
    try:
        return SamplingParams(
            max_tokens=req.max_tokens or room, n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0, seed=req.seed, ignore_eos=req.ignore_eos,
            stop_token_ids=list(req.stop_token_ids or []), min_tokens=req.min_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
