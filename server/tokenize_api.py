"""POST /tokenize and POST /detokenize, as vLLM serves them (outside /v1, so no API
key is needed). /tokenize takes either a prompt or chat messages."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from engine.client.engine_client import EngineClient
from server.chat_template import refuse_untrusted_template, render_chat, render_chat_text
from server.errors import APIError, no_tokenizer
from server.protocol import ChatMessage, OpenAIRequest
from server.tokenization import Tokenization
from server.validation import check_model, encode_text


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
    """The tokenizer runs on `tokenization`'s thread, never on the event loop. A
    prompt longer than the context is still counted here (that is what /tokenize is
    for), so no length shortcut applies."""
    router = APIRouter()
    tok = engine.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse_tokenize(request)
        check_model(req.model, model_names, engine.adapters.served)
        if isinstance(req, TokenizeChatRequest):
            refuse_untrusted_template(req.chat_template, req.chat_template_kwargs,
                                      trust_chat_template)
        if tok is None:
            raise no_tokenizer()
        return await tokenization.run(_tokenize, tok, req, engine.max_model_len)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model, model_names, engine.adapters.served)
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


def _tokenize(tok, req: TokenizeCompletionRequest | TokenizeChatRequest,
              max_model_len: int) -> dict[str, Any]:
    ids = (_chat_ids(tok, req) if isinstance(req, TokenizeChatRequest)
           else encode_text(tok, req.prompt, add_special_tokens=req.add_special_tokens))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return body


def _chat_ids(tokenizer, req: TokenizeChatRequest) -> list[int]:
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    args = dict(chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
    if not req.add_special_tokens:
        return render_chat(tokenizer, messages, req.add_generation_prompt,
                           req.continue_final_message, **args)
    text = render_chat_text(tokenizer, messages, req.add_generation_prompt,
                            req.continue_final_message, **args)
    return encode_text(tokenizer, text, add_special_tokens=True)
