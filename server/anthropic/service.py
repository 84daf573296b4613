"""POST /v1/messages and /v1/messages/count_tokens on the chat route's machinery: the
request becomes a chat request (server/anthropic/inputs.py), ChatService.prepare
checks it and renders its prompt, the chat view reads the output (reasoning, text,
tool calls, each tool call held to valid JSON by the grammars of server/tools.py)
and the MessageWriter tells it as Anthropic's content blocks and events.

What one request can cost is what a chat request can, less its n: one sequence, the
prompt and the output together at most the model's context (max_model_len tokens);
the body at most --max-request-body-bytes (10 MiB), tokenized off the event loop and
refused unread when it cannot fit the context (server/prompt_length.py); at most
--max-stop-strings stop sequences of 256 characters each, --max-tools tools whose
schemas take at most --max-grammar-spec-bytes (512 KiB) and --max-grammar-spec-depth
levels together (server/request_caps.py, server/grammar_limits.py); waiting behind
--max-waiting-requests and --max-waiting-tokens (server/admission.py), cut at
--request-timeout. max_tokens past what the context leaves is no 400, as on
Anthropic's own newer models: the output stops where the context ends, with
stop_reason "model_context_window_exceeded" (Claude Code asks for tens of thousands
of tokens on every turn, more than many local models' whole context). count_tokens renders and
tokenizes a prompt, generating nothing."""
from __future__ import annotations

import contextlib
import dataclasses

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvserve.server import generation
from kvserve.server.anthropic.errors import PARAMS, sse_error
from kvserve.server.anthropic.inputs import (chat_messages, chat_tool_choice, chat_tools,
                                             is_prefill, reasoning_effort, system_messages,
                                             thinking_switch)
from kvserve.server.anthropic.output import MessageWriter, stop_reason, usage
from kvserve.server.anthropic.protocol import (AnthropicRequest, MessagesRequest,
                                               message_id, refuse_extras)
from kvserve.server.chat import ChatService, ChatView
from kvserve.server.chat_stream import DeltaRelay, typed_events
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.request_owners import ENGINE_ID_HEADER, engine_request_id


class MessagesService:
    def __init__(self, chat: ChatService):
        self.chat = chat

    async def create(self, req: MessagesRequest):
        chat_req, shown = chat_request(req)
        view = await self.chat.prepare(chat_req)
        past_context = _hold_to(view, req.max_tokens)
        writer = MessageWriter(message_id(), view.model, len(view.groups[0].prompt_ids),
                               shown)
        opts = self.chat.text_options(chat_req)
        engine_id = engine_request_id()  # random: the public id is not learnt from it
        headers = {ENGINE_ID_HEADER: engine_id}
        stops = req.stop_strings()
        if req.stream:
            events = generation.stream(self.chat.engine, engine_id, view.groups, opts)
            return StreamingResponse(self._sse(view, writer, events, stops, past_context),
                                     media_type="text/event-stream", headers=headers)
        results = await generation.collect(self.chat.engine, engine_id, view.groups, opts)
        deltas = results[0]
        choice = view.choice(0, deltas)
        writer.delta(_as_delta(choice["message"]))
        reason, sequence = stop_reason(choice["finish_reason"], deltas[-1].stop_reason,
                                       stops, past_context)
        writer.finish(reason, sequence, _usage(view, deltas[-1]))
        return JSONResponse(writer.body(), headers=headers)

    async def count_tokens(self, req: AnthropicRequest) -> dict:
        """The prompt /v1/messages would run for the same conversation, tools and
        thinking, counted: the same checks (a prompt past the context is a 400)."""
        chat_req, _ = chat_request(req)
        view = await self.chat.prepare(chat_req)
        return {"input_tokens": len(view.groups[0].prompt_ids)}

    async def _sse(self, view: ChatView, writer: MessageWriter, events, stops: list[str],
                   past_context: bool):
        yield typed_events(writer.start())
        relay = DeltaRelay()
        async with contextlib.aclosing(relay.frames(view, writer, events)) as frames:
            async for frame in frames:
                yield frame
        last, finish, error = relay.last, relay.finish, relay.error
        if error is not None:  # the 200 is sent: the stream ends with an error event
            yield sse_error(error.status, error.message)
            return
        reason, sequence = stop_reason(finish, last.stop_reason if last else None, stops,
                                       past_context)
        use = _usage(view, last) if last is not None else usage(
            len(view.groups[0].prompt_ids), 0, 0)
        yield typed_events(writer.finish(reason, sequence, use))


def chat_request(req: AnthropicRequest) -> tuple[ChatCompletionRequest, bool]:
    """(the chat request, whether thinking is shown). A conversation that ends with
    the assistant's text is continued (Anthropic's prefill), not answered anew.
    max_tokens is left to _hold_to: the chat request asks for all the room there is."""
    refuse_extras(req)
    conversation = chat_messages(req.messages)
    prefill = is_prefill(req.messages, conversation)
    enable_thinking, shown = thinking_switch(req.thinking)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if enable_thinking is not None:
        template_kwargs.setdefault("enable_thinking", enable_thinking)
    fields = dict(model=req.model, messages=system_messages(req.system) + conversation,
                  add_generation_prompt=not prefill, continue_final_message=prefill,
                  chat_template_kwargs=template_kwargs or None,
                  reasoning_effort=reasoning_effort(req.output_config))
    if isinstance(req, MessagesRequest):
        fields.update(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stop=req.stop_sequences, stream=req.stream)
        fields.update((k, v) for k, v in (req.model_extra or {}).items()
                      if k in req.allowed_extras)
    tools = chat_tools(req.tools)
    choice, parallel = chat_tool_choice(req.tool_choice)
    if tools:
        fields["tools"] = tools
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    try:
        return ChatCompletionRequest(**fields), shown
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "messages"
        param = PARAMS.get(field, field)
        raise APIError(400, f"{param}: {first['msg']}", param) from None


def _hold_to(view: ChatView, max_tokens: int) -> bool:
    """Caps the prepared request's output at max_tokens, or at the context's end if
    that comes first (then True)."""
    group = view.groups[0]
    room = group.params.max_tokens  # prepared without max_tokens: all the room left
    held = min(max_tokens, room)
    if group.params.min_tokens > held:
        raise APIError(400, f"min_tokens must be at most max_tokens={held}, got "
                       f"{group.params.min_tokens}", "min_tokens")
    group.params = dataclasses.replace(group.params, max_tokens=held)
    return max_tokens > room


def _usage(view: ChatView, last) -> dict:
    chat = generation.usage(view.groups, {0: last})
    return usage(chat["prompt_tokens"], chat["completion_tokens"],
                 chat["prompt_tokens_details"]["cached_tokens"])


def _as_delta(message: dict) -> dict:
    """A whole chat message as one streamed delta (its tool calls numbered)."""
    calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls") or ())]
    return {**message, "tool_calls": calls}
