"""POST /v1/chat/completions: messages -> the model's chat template -> one prompt
with n choices, answered as a chat.completion or streamed chat.completion.chunks."""
from __future__ import annotations

import dataclasses

from kvserve.server import beam_search
from kvserve.server.chat_template import (chat_prompt_ids, refuse_untrusted_template,
                                          render_chat_text)
from kvserve.server.generation import ChoiceDelta, PromptGroup
from kvserve.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from kvserve.server.protocol import ChatCompletionRequest, chat_completion_id
from kvserve.server.reasoning import ReasoningStream, reasoning_parser
from kvserve.server.response_view import ResponseView
from kvserve.server.service import GenerationService
from kvserve.server.spec_thread import run_off_loop
from kvserve.server.structured_fields import AskedGrammar, asks_for_structure, structured_output
from kvserve.server.tool_parsers import CallStream
from kvserve.server.tools import ToolPlan, tool_plan
from kvserve.server.unsupported_fields import CHAT_FIELDS
from kvserve.server.validation import (bad_words_token_ids, check_prompt, output_budget,
                                       prompt_logprobs_k, sampling_params)


class ChatService(GenerationService):
    unsupported_fields = CHAT_FIELDS

    async def create(self, req: ChatCompletionRequest):
        view = await self.prepare(req)
        if req.use_beam_search:
            return await beam_search.respond(self, view, view.groups, req)
        return await self.respond(view, view.groups, req)

    async def prepare(self, req: ChatCompletionRequest) -> ChatView:
        """Everything before generation: checks, tool plan, prompt, sampling; the view
        that reads the output as chat (the Responses API reads it through this too)."""
        model = self.served_model(req)
        refuse_untrusted_template(req.chat_template, req.chat_template_kwargs,
                                  self.config.trust_request_chat_template)
        tokenizer = self.engine.tokenizer
        plan, asked = await self._grammars(req)
        if plan is not None and plan.format is not None and plan.format.keeps_special_tokens:
            req.skip_special_tokens = False  # the calls' opening is a special token
        text, ids = await self.tokenization.run(self._prompt, req, plan)
        words = await self.tokenization.run(bad_words_token_ids, tokenizer,
                                            req.bad_words) if req.bad_words else None
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_tokens = output_budget(req.max_output_tokens, len(ids),
                                   self.engine.max_model_len, param)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tool_grammar = plan.structured if plan is not None else None
        groups = [PromptGroup(0, ids, sampling_params(
            req, max_tokens, self.vocab_size, num_logprobs,
            prompt_logprobs_k(req, self.vocab_size), tool_grammar=tool_grammar,
            structured=asked.spec if asked is not None else None,
            has_tokenizer=tokenizer is not None, bad_words=words),
            grammar_param="tools" if tool_grammar is not None
            else asked.param if asked is not None else None)]
        view = ChatView(chat_completion_id(), model, req, groups, tokenizer)
        view.plan = plan if plan is not None and plan.mode != "none" else None
        parser = reasoning_parser(self.config.reasoning_parser)
        if parser is not None:
            constrained = groups[0].params.structured is not None and (
                plan is None or plan.mode != "auto")  # "auto" leaves text free
            view.reasoning = lambda: parser.stream(text, constrained)
        return view

    async def _grammars(self, req: ChatCompletionRequest
                        ) -> tuple[ToolPlan | None, AskedGrammar | None]:
        """The tool plan and the structured output, read, held to the caps and parsed
        off the event loop (a request that asks for neither skips the trip)."""
        extra = req.model_extra or {}
        if not extra.get("tools") and extra.get("tool_choice") is None \
                and not asks_for_structure(req):
            return None, None
        template = req.chat_template or getattr(self.engine.tokenizer, "chat_template", None)
        backend, limits = self.engine.structured_backend, self.grammar_limits

        def read():
            plan = tool_plan(extra.get("tools"), extra.get("tool_choice"),
                             extra.get("parallel_tool_calls"), template,
                             self.config.tool_call_parser, backend, limits)
            return plan, structured_output(req, backend, limits)

        return await run_off_loop(read)

    def _prompt(self, req: ChatCompletionRequest,
                plan: ToolPlan | None) -> tuple[str, list[int]]:
        """On the tokenizer's thread: the template, then the length check on what
        it rendered (a template need not use every message), then the tokens."""
        text = render_chat_text(self.engine.tokenizer, req.message_dicts(),
                                req.add_generation_prompt, req.continue_final_message,
                                chat_template=req.chat_template,
                                chat_template_kwargs=req.template_kwargs(),
                                tools=plan.tools if plan is not None else None,
                                tool_format=plan.format if plan is not None else None)
        self.tokenization.refuse_if_too_long(text, "messages")
        return text, check_prompt(self.engine, chat_prompt_ids(self.engine.tokenizer, text),
                                  "messages")


class ChatView(ResponseView):
    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    plan: ToolPlan | None = None  # tool calls (not "none"): how the output is read
    reasoning = None  # --reasoning-parser: () -> a ReasoningStream for one choice

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held: dict[int, str] = {}  # "required" output per choice, until it ends
        self._parsers: dict[int, CallStream] = {}  # "auto": per choice
        self._calls: dict[int, int] = {}  # "auto": calls sent per choice
        self._thoughts: dict[int, ReasoningStream] = {}  # per choice, when reasoning

    def _logprobs(self, deltas: list[ChoiceDelta]) -> dict | None:
        if not self.req.logprobs:
            return None
        entries = [e for d in deltas for e in d.logprobs]
        return chat_logprobs(entries, self.token_text, self.req.top_logprobs or 0)

    def choice(self, index: int, deltas: list[ChoiceDelta]) -> dict:
        text = "".join(d.text for d in deltas)
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning().whole(text)
        message, finish = {"role": "assistant", "content": text}, deltas[-1].finish_reason
        content, calls = (self.plan.read(text or "")
                          if self.plan is not None and finish == "stop" else (text, None))
        if calls:
            message, finish = {"role": "assistant", "content": content or None,
                               "tool_calls": calls}, "tool_calls"
        if self.reasoning is not None:
            message["reasoning_content"] = thought
        choice = {"index": index, "message": message,
                  "logprobs": self._logprobs(deltas),
                  "finish_reason": finish,
                  "stop_reason": deltas[-1].stop_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return choice

    def body(self, results: dict[int, list[ChoiceDelta]]) -> dict:
        body = super().body(results)
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.groups[0].prompt_ids
        if self.req.prompt_logprobs is not None:  # vLLM's: once, beside the choices
            k = self.req.prompt_logprobs  # -1: all the engine listed
            body["prompt_logprobs"] = vllm_prompt_logprobs(
                results[min(results)][0].prompt_logprobs, self.token_text,
                k if k >= 0 else None)
        return body

    def chunk_choices(self, d: ChoiceDelta) -> list[dict]:
        thought = ""
        if self.reasoning is not None:
            thought, d = self._split_thought(d)
        delta, finish = {"content": d.text}, d.finish_reason
        if self.plan is not None:
            delta, finish = self.streamed_calls(d)
        if self.reasoning is not None:  # only what this delta carries
            delta = {k: v for k, v in delta.items() if v}
            if thought:
                delta = {"reasoning_content": thought, **delta}
        choice = {"index": d.index, "delta": delta,
                  "logprobs": self._logprobs([d]), "finish_reason": finish}
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        if self.req.return_token_ids:
            choice["token_ids"] = d.token_ids
        # A tool call's text is held until the call is whole: no empty chunks meanwhile.
        carries = delta or finish or choice["logprobs"] or self.req.return_token_ids
        choices = [choice] if carries else []
        if not d.first:
            return choices
        # As OpenAI and vLLM do: the role comes first, in a chunk of its own.
        role = {"index": d.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}
        return [role, *choices]

    def _split_thought(self, d: ChoiceDelta) -> tuple[str, ChoiceDelta]:
        """This delta's reasoning, and the delta with only its answer text left."""
        stream = self._thoughts.get(d.index)
        if stream is None:
            stream = self._thoughts[d.index] = self.reasoning()
        thought, answer = stream.feed(d.text)
        if d.finish_reason is not None:
            more_thought, more_answer = stream.finish()
            thought, answer = thought + more_thought, answer + more_answer
        return thought, dataclasses.replace(d, text=answer)

    def streamed_calls(self, d: ChoiceDelta) -> tuple[dict, str | None]:
        """A tool-calling delta, as OpenAI frames it: a named function's id and name
        first, its arguments as they come; "required" calls (a JSON array until it is
        whole) each with id, name and arguments when the output ends; "auto" by the
        format's parser (_auto_delta). Output cut short (finish "length") is sent as
        the text it is."""
        done = d.finish_reason == "stop"
        finish = "tool_calls" if done else d.finish_reason
        if self.plan.mode == "auto":
            return self._auto_delta(d)
        if self.plan.mode == "named":
            if d.first:
                call = self.plan.call(self.plan.name, d.text)
                return {"tool_calls": [{"index": 0, **call}]}, finish
            return ({"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}
                    if d.text else {}), finish
        self._held[d.index] = self._held.get(d.index, "") + d.text
        if d.finish_reason is None:
            return {}, None
        text = self._held.pop(d.index)
        calls = self.plan.read(text)[1] if done else None
        if not calls:
            return {"content": text}, d.finish_reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, finish

    def _auto_delta(self, d: ChoiceDelta) -> tuple[dict, str | None]:
        """"auto": the text outside the calls as content, each call whole (id, name,
        arguments) once it is complete; nothing of the format's markup leaks."""
        if d.index not in self._parsers:
            self._parsers[d.index] = self.plan.format.stream()
        parser = self._parsers[d.index]
        content, calls = parser.feed(d.text)
        if d.finish_reason is not None:
            content += parser.rest()
        delta: dict = {"content": content} if content else {}
        if calls:
            first = self._calls.get(d.index, 0)
            delta["tool_calls"] = [{"index": first + i, **self.plan.call(name, args)}
                                   for i, (name, args) in enumerate(calls)]
            self._calls[d.index] = first + len(calls)
        finish = d.finish_reason
        if finish == "stop" and self._calls.get(d.index):
            finish = "tool_calls"
        return delta, finish
