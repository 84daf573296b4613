"""POST /v1/responses on the chat route's machinery: the request becomes a chat
request (server/responses/inputs.py), the chat view reads the output (reasoning,
text, tool calls) and the OutputWriter tells it as Responses items and events;
stored responses answer GET/DELETE and previous_response_id."""
from __future__ import annotations

import contextlib
import time

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvserve.server import generation
from kvserve.server.chat import ChatService, ChatView
from kvserve.server.chat_stream import DeltaRelay, typed_events
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, SamplingFields
from kvserve.server.request_owners import ENGINE_ID_HEADER, engine_request_id
from kvserve.server.responses.inputs import (chat_response_format, chat_tool_choice, chat_tools,
                                             input_messages)
from kvserve.server.responses.output import OutputWriter
from kvserve.server.responses.protocol import ResponsesRequest, refuse_hosted_features, response_id
from kvserve.server.responses.store import ResponseStore

# vLLM's sampling extras (top_k, min_p, penalties, stop, logit_bias, ignore_eos, ...)
# pass through as they do on chat; what the Responses API names itself, or what has
# no meaning here (n choices, token ids, chat stream options), does not.
SAMPLING_EXTRAS = set(SamplingFields.model_fields) - {
    "model", "temperature", "top_p", "n", "stream", "stream_options", "user", "seed",
    "return_token_ids"}
# The chat route's names for what a Responses client calls otherwise.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore):
        self.chat, self.store = chat, store

    async def create(self, req: ResponsesRequest, owner: str):
        """owner: the caller's owner tag (server/auth.py): it continues and stores
        responses of its own only."""
        refuse_hosted_features(req)
        history = self._stored(req.previous_response_id, owner,
                               "previous_response_id").messages \
            if req.previous_response_id else []
        conversation = history + input_messages(req.input)
        chat_req = _chat_request(req, conversation)
        with _responses_params():
            view = await self.chat.prepare(chat_req)
        view.rid = response_id()
        writer = OutputWriter(_envelope(req, view.rid, view.model))
        opts = self.chat.text_options(chat_req)
        engine_id = engine_request_id()  # random: the public id is not learnt from it
        headers = {ENGINE_ID_HEADER: engine_id}
        if req.stream:
            events = generation.stream(self.chat.engine, engine_id, view.groups, opts)
            return StreamingResponse(self._sse(req, view, writer, events, conversation,
                                               owner), media_type="text/event-stream",
                                     headers=headers)
        results = await generation.collect(self.chat.engine, engine_id, view.groups, opts)
        choice = view.choice(0, results[0])
        writer.delta(_as_delta(choice["message"]))
        writer.finish(choice["finish_reason"], self._usage(view, results[0][-1], writer))
        self._keep(req, writer, conversation, owner)
        return JSONResponse(writer.body(), headers=headers)

    async def _sse(self, req: ResponsesRequest, view: ChatView, writer: OutputWriter,
                   events, conversation: list[dict], owner: str):
        yield typed_events(writer.start())
        relay = DeltaRelay()
        async with contextlib.aclosing(relay.frames(view, writer, events)) as frames:
            async for frame in frames:
                yield frame
        last, finish, error = relay.last, relay.finish, relay.error
        usage = self._usage(view, last, writer) if last is not None else None
        yield typed_events(writer.finish(finish, usage, error.message if error else None))
        if error is None:
            self._keep(req, writer, conversation, owner)

    def retrieve(self, rid: str, owner: str) -> dict:
        return self._stored(rid, owner, "response_id").body

    def delete(self, rid: str, owner: str) -> dict:
        if not self.store.delete(rid, owner):
            raise _not_found(rid, "response_id")
        return {"id": rid, "object": "response", "deleted": True}

    def _stored(self, rid: str, owner: str, param: str):
        stored = self.store.get(rid, owner)
        if stored is None:
            raise _not_found(rid, param)
        return stored

    def _keep(self, req: ResponsesRequest, writer: OutputWriter, conversation: list[dict],
              owner: str):
        """A stored response keeps its conversation (the instructions are not carried
        on, as OpenAI does) with its own output as the assistant's turn."""
        if req.store:
            self.store.put(writer.response["id"], writer.body(),
                           conversation + [assistant_message(writer.response["output"])],
                           owner)

    def _usage(self, view: ChatView, last, writer: OutputWriter) -> dict:
        chat = generation.usage(view.groups, {0: last})
        thought = _text_of(writer.response["output"], "reasoning")
        tokenizer = self.chat.engine.tokenizer
        reasoning = len(tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0},
                "output_tokens": chat["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": chat["total_tokens"]}


def assistant_message(output: list[dict]) -> dict:
    """A response's output items as the assistant's chat message (for the history)."""
    message: dict = {"role": "assistant", "content": _text_of(output, "message") or None}
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    thought = _text_of(output, "reasoning")
    if thought:
        message["reasoning_content"] = thought
    return message


def _text_of(output: list[dict], kind: str) -> str:
    """The text of a response's items of one kind ("message" or "reasoning")."""
    return "".join(i["content"][0]["text"] for i in output if i["type"] == kind)


def _as_delta(message: dict) -> dict:
    """A whole chat message as one streamed delta (its tool calls numbered)."""
    calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls") or ())]
    return {**message, "tool_calls": calls}


def _chat_request(req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    fields = dict(model=req.model, messages=system + conversation,
                  max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                  top_p=req.top_p, seed=req.seed, stream=req.stream, user=req.user,
                  chat_template_kwargs=req.chat_template_kwargs,
                  reasoning_effort=(req.reasoning or {}).get("effort"))
    fields.update((k, v) for k, v in (req.model_extra or {}).items() if k in SAMPLING_EXTRAS)
    tools = chat_tools(req.tools)
    if tools:
        fields.update(tools=tools, parallel_tool_calls=req.parallel_tool_calls)
    extra = dict(tool_choice=chat_tool_choice(req.tool_choice),
                 response_format=chat_response_format(req.text))
    fields.update((k, v) for k, v in extra.items() if v is not None)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "messages"
        param = _PARAMS.get(field, field)
        raise APIError(400, f"{param}: {first['msg']}", param) from None


def _envelope(req: ResponsesRequest, rid: str, model: str) -> dict:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls,
            "text": req.text or {"format": {"type": "text"}},
            "previous_response_id": req.previous_response_id, "metadata": req.metadata or {},
            "store": req.store, "user": req.user, "reasoning": req.reasoning,
            "truncation": req.truncation or "disabled", "background": False}


@contextlib.contextmanager
def _responses_params():
    """The chat route's 4xx, naming the Responses API's field."""
    try:
        yield
    except APIError as exc:
        exc.param = _PARAMS.get(exc.param, exc.param)
        raise


def _not_found(rid: str, param: str) -> APIError:
    return APIError(404, f"Response with id {rid!r} not found (stored responses live in "
                    "this server's memory, for --responses-store-ttl seconds, and not "
                    "across restarts).", param)
