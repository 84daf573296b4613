"""POST /tokenize and POST /detokenize, as vLLM serves them (outside /v1, but behind
the API key when one is set: server/auth.py). /tokenize takes either a prompt or chat
messages.

Neither can delay generation: they run on a thread of their own with a tokenizer of
their own (`tokenization`, not the one chat and completions prompts queue on), and
refuse what generation would refuse for length: a prompt (or rendered chat) that
cannot fit the context, more token ids than the context holds."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.chat_template import (chat_prompt_ids, refuse_untrusted_template,
                                          render_chat_text)
from kvserve.server.errors import APIError, no_tokenizer
from kvserve.server.json_body import OffLoopJSONRoute
from kvserve.server.protocol import ChatMessage, OpenAIRequest
from kvserve.server.tokenization import Tokenization
from kvserve.server.validation import check_model, encode_text


class TokenizeCompletionRequest(OpenAIRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIRequest):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template already writes BOS and turn markers: do not add them twice.
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


def tokenize_router(engine: EngineClient, model_names: list[str],
                    tokenization: Tokenization, trust_chat_template: bool = False
                    ) -> APIRouter:
    """The tokenizer runs on `tokenization`'s thread (its own tokenizer), never on
    the event loop nor on the generation prompts' thread."""
    router = APIRouter(route_class=OffLoopJSONRoute)  # prompts of megabytes
    tok = tokenization.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse_tokenize(request)
        check_model(req.model, model_names, engine.adapters.served)
        if isinstance(req, TokenizeChatRequest):
            refuse_untrusted_template(req.chat_template, req.chat_template_kwargs,
                                      trust_chat_template)
        if tok is None:
            raise no_tokenizer()
        return await tokenization.run(_tokenize, tokenization, req)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model, model_names, engine.adapters.served)
        if len(req.tokens) > engine.max_model_len:
            raise APIError(400, f"{len(req.tokens)} token ids, more than this model's "
                           f"maximum context length ({engine.max_model_len})", "tokens")
        bad = next((t for t in req.tokens if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of the vocabulary "
                           f"(0..{engine.vocab_size - 1})", "tokens")
        if tok is None:
            raise no_tokenizer()
        return {"prompt": await tokenization.run(tok.decode, req.tokens)}

    return router


async def _parse_tokenize(request: Request) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body's form is chosen by its keys (`messages` or not), not by trying both
    models, so an error names the field of the form the client meant."""
    try:
        data = await request.json()
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    is_chat = isinstance(data, dict) and "messages" in data
    model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as exc:  # the app's handler turns this into OpenAI's 400
        raise RequestValidationError(exc.errors()) from None


def _tokenize(tokenization: Tokenization, req: TokenizeCompletionRequest | TokenizeChatRequest
              ) -> dict[str, Any]:
    """On the routes' tokenizer thread: the length check (as completions and chat do
    it), then the tokens."""
    tok = tokenization.tokenizer
    if isinstance(req, TokenizeChatRequest):
        ids = _chat_ids(tokenization, req)
    else:
        tokenization.refuse_if_too_long(req.prompt, "prompt")
        ids = encode_text(tok, req.prompt, add_special_tokens=req.add_special_tokens)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": tokenization.max_model_len,
                            "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return body


def _chat_ids(tokenization: Tokenization, req: TokenizeChatRequest) -> list[int]:
    tokenizer = tokenization.tokenizer
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    args = dict(chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
    text = render_chat_text(tokenizer, messages, req.add_generation_prompt,
                            req.continue_final_message, **args)
    tokenization.refuse_if_too_long(text, "messages")
    if not req.add_special_tokens:
        return chat_prompt_ids(tokenizer, text)
    return encode_text(tokenizer, text, add_special_tokens=True)
