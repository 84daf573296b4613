"""POST /v1/completions: prompts -> engine requests -> text, whole or streamed (SSE)."""
from __future__ import annotations

from kvserve.server import beam_search
from kvserve.server.errors import APIError
from kvserve.server.generation import ChoiceDelta, PromptGroup
from kvserve.server.logprobs import (completion_logprobs, merge_completion_logprobs,
                                     prompt_completion_logprobs, vllm_prompt_logprobs)
from kvserve.server.protocol import CompletionRequest, completion_id
from kvserve.server.response_view import ResponseView
from kvserve.server.service import GenerationService
from kvserve.server.spec_thread import run_off_loop
from kvserve.server.structured_fields import AskedGrammar, asks_for_structure, structured_output
from kvserve.server.unsupported_fields import COMPLETION_FIELDS
from kvserve.server.validation import (bad_words_token_ids, output_budget,
                                       prompt_logprobs_k, prompt_token_ids, sampling_params)


class CompletionService(GenerationService):
    unsupported_fields = COMPLETION_FIELDS

    async def create(self, req: CompletionRequest):
        model = self.served_model(req)
        if req.prompt == "":  # vLLM's check: it would be BOS alone, or nothing
            raise APIError(400, "prompt must not be empty", "prompt")
        prompts = req.prompts()
        if not prompts:  # prompt: []
            raise APIError(400, "the prompt is empty", "prompt")
        limit = self.config.max_prompts_per_request
        if limit and len(prompts) > limit:
            raise APIError(400, f"too many prompts in one request: {len(prompts)} (limit "
                           f"{limit}, --max-prompts-per-request)", "prompt")
        choices = self.config.max_choices_per_request
        if choices and len(prompts) * req.n > choices:
            raise APIError(400, f"too many choices in one request: {len(prompts)} prompts "
                           f"x n={req.n} (limit {choices}, --max-choices-per-request)", "n")
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.tokenization.refuse_if_too_long(text, "prompt")
        # Read, held to the caps and parsed off the event loop (server/spec_thread.py).
        asked = (await run_off_loop(structured_output, req, self.engine.structured_backend,
                                    self.grammar_limits)
                 if asks_for_structure(req) else None)
        encode = lambda: [prompt_token_ids(self.engine, p) for p in prompts]  # noqa: E731
        # Token ids need no tokenizer: checking them costs less than parsing them
        # did, so they do not wait behind someone else's long text.
        ids = await self.tokenization.run(encode) if texts else encode()
        words = await self.tokenization.run(bad_words_token_ids, self.engine.tokenizer,
                                            req.bad_words) if req.bad_words else None
        groups = [self._group(i, p, req, prompt_ids, asked, words)
                  for i, (p, prompt_ids) in enumerate(zip(prompts, ids))]
        view = _CompletionView(completion_id(), model, req, groups, self.engine.tokenizer)
        if req.use_beam_search and not req.echo_only:  # echo_only generates nothing
            return await beam_search.respond(self, view, groups, req)
        return await self.respond(view, groups, req)

    def _group(self, index: int, prompt: str | list[int], req: CompletionRequest,
               ids: list[int], asked: AskedGrammar | None,
               bad_words: list[list[int]] | None = None):
        # The engine always generates; for echo_only its one token is left out.
        max_tokens = 1 if req.echo_only else output_budget(req.max_tokens, len(ids),
                                                             self.engine.max_model_len)
        params = sampling_params(req, max_tokens, self.vocab_size, req.logprobs,
                                 self._prompt_logprobs(req),
                                 structured=asked.spec if asked is not None else None,
                                 has_tokenizer=self.engine.tokenizer is not None,
                                 bad_words=bad_words)
        return PromptGroup(index, ids, params, prompt if isinstance(prompt, str) else None,
                           count_output=not req.echo_only,
                           grammar_param=asked.param if asked is not None else None)

    def _prompt_logprobs(self, req: CompletionRequest) -> int | None:
        """The top k the engine lists per prompt token: echo's logprobs and vLLM's
        prompt_logprobs read one list, each keeping its own k of it."""
        ks = [k for k in (req.logprobs if req.echo else None,
                          prompt_logprobs_k(req, self.vocab_size)) if k is not None]
        return max(ks, default=None)


class _CompletionView(ResponseView):
    body_object = chunk_object = "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self.offsets: dict[int, int] = {}  # choice -> characters sent so far

    def _group_of(self, choice_index: int) -> PromptGroup:
        return self.groups[choice_index // self.groups[0].params.n]

    def _echo_text(self, g: PromptGroup) -> str:
        if g.prompt_text is not None:
            return g.prompt_text
        return self.tokenizer.decode(g.prompt_ids,
                                     skip_special_tokens=self.req.skip_special_tokens)

    def _render(self, d: ChoiceDelta) -> dict:
        """A delta as a choice; on the first delta, the echoed prompt goes first."""
        # echo_only: the engine's one token is not part of the answer
        generated, entries = ("", []) if self.req.echo_only else (d.text, d.logprobs)
        text, logprobs = generated, None
        offset = self.offsets.get(d.index, 0)
        echo = d.first and self.req.echo
        if echo:
            prefix = self._echo_text(self._group_of(d.index))
            text, offset = prefix + text, len(prefix)
        if self.req.logprobs is not None:
            logprobs = completion_logprobs(entries, self.token_text, offset)
            if echo:
                g = self._group_of(d.index)
                prompt = prompt_completion_logprobs(
                    g.prompt_ids, d.prompt_logprobs or [None] * len(g.prompt_ids),
                    self.token_text, self.req.logprobs)
                logprobs = merge_completion_logprobs(prompt, logprobs)
        self.offsets[d.index] = offset + len(generated)
        choice = {"index": d.index, "text": text, "logprobs": logprobs,
                  "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = [] if self.req.echo_only else d.token_ids
            if d.first:
                choice["prompt_token_ids"] = self._group_of(d.index).prompt_ids
        return choice

    def chunk_choices(self, d: ChoiceDelta) -> list[dict]:
        return [self._render(d)]

    def choice(self, index: int, deltas: list[ChoiceDelta]) -> dict:
        parts = [self._render(d) for d in deltas]
        whole = parts[-1] | {"text": "".join(p["text"] for p in parts)}
        if self.req.return_token_ids:
            whole["token_ids"] = [t for p in parts for t in p["token_ids"]]
            whole["prompt_token_ids"] = parts[0]["prompt_token_ids"]
        if self.req.logprobs is not None:
            merged = parts[0]["logprobs"]
            for p in parts[1:]:
                merged = merge_completion_logprobs(merged, p["logprobs"])
            whole["logprobs"] = merged
        if self.req.prompt_logprobs is not None:  # vLLM's: on every choice of its prompt
            k = self.req.prompt_logprobs  # -1: all the engine listed
            whole["prompt_logprobs"] = vllm_prompt_logprobs(
                deltas[0].prompt_logprobs, self.token_text, k if k >= 0 else None)
        return whole
