"""POST /v1/completions: prompts -> engine requests -> text, whole or streamed (SSE)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse, StreamingResponse

from engine.async_engine import AsyncEngine, EngineDeadError
from scheduler.sampling_params import SamplingParams
from server.detokenizer import IncrementalDetokenizer
from server.errors import APIError, sse_data, sse_error
from server.protocol import CompletionRequest, completion_id
from server.validation import check_model, prompt_token_ids, sampling_params


@dataclass
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0  # tokens generated so far for this choice


@dataclass
class PromptGroup:
    """One prompt and its n sequences: one engine request; the sequences share the
    prompt's KV blocks. Choice indices are prompt_index * n + sequence index."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams

    def choice_index(self, seq_index: int) -> int:
        return self.index * self.params.n + seq_index


class CompletionService:
    def __init__(self, engine: AsyncEngine, model_names: list[str]):
        self.engine = engine
        self.model_names = model_names

    async def create(self, req: CompletionRequest):
        model = check_model(req.model, self.model_names)
        if not self.engine.is_alive:  # say so with a status, not inside a 200 stream
            raise APIError(503, "the engine is not running")
        prompts = [prompt_token_ids(self.engine, p) for p in req.prompts()]
        if not prompts:  # prompt: []
            raise APIError(400, "the prompt is empty", "prompt")
        groups = [PromptGroup(i, ids, sampling_params(req, len(ids), self.engine.max_model_len))
                   for i, ids in enumerate(prompts)]
        rid = completion_id()
        if req.stream:
            return StreamingResponse(self._stream(rid, model, req, groups),
                                     media_type="text/event-stream")
        return JSONResponse(await self._complete(rid, model, req, groups))

    async def _run_prompt(self, rid: str, req: CompletionRequest, group: PromptGroup, emit):
        """Drive one prompt's n sequences to the end, calling emit(ChoiceDelta) as
        text becomes final. A stop string ends its sequence early (aborted in the
        engine); leaving the generator aborts whatever still runs."""
        detoks = [IncrementalDetokenizer(self.engine.tokenizer, group.prompt_ids,
                                         req.stop_strings(), req.include_stop_str_in_output,
                                         req.skip_special_tokens)
                  for _ in range(group.params.n)]
        counts = [0] * group.params.n
        done = [False] * group.params.n
        gen = self.engine.generate(f"{rid}-{group.index}", group.prompt_ids, group.params,
                                   cache_salt=req.cache_salt, priority=req.priority)
        async with contextlib.aclosing(gen):
            async for out in gen:
                j = out.index
                if done[j]:
                    continue  # the abort that follows a stop string
                counts[j] += len(out.new_token_ids)
                delta = self._advance(detoks[j], out, req)
                if delta is not None:
                    delta.index, delta.num_tokens = group.choice_index(j), counts[j]
                    done[j] = delta.finish_reason is not None
                    if done[j] and not out.finished:
                        self.engine.abort(out.request_id)
                    await emit(delta)

    @staticmethod
    def _advance(detok: IncrementalDetokenizer, out, req) -> ChoiceDelta | None:
        """Feed one engine output to the sequence's detokenizer; the delta to send,
        if any (index and token count are filled in by the caller)."""
        new = out.new_token_ids
        if out.finish_reason == "stop" and not req.include_stop_str_in_output:
            new = new[:-1]  # as in vLLM, the EOS / stop token's text is left out
        detok.add_tokens(new)
        if detok.stop_reason is not None:
            return ChoiceDelta(0, detok.flush(True), "stop", detok.stop_reason)
        finish = out.finish_reason if out.finished else None
        text = detok.flush(out.finished)
        if text or finish:
            return ChoiceDelta(0, text, finish, out.stop_reason)
        return None

    async def _complete(self, rid, model, req, groups) -> dict:
        results: dict[int, list[ChoiceDelta]] = {}

        async def collect(d: ChoiceDelta):
            results.setdefault(d.index, []).append(d)

        await _gather_or_raise([self._run_prompt(rid, req, g, collect) for g in groups])
        body_choices, completion_tokens = [], 0
        for index in sorted(results):
            parts = results[index]
            last = parts[-1]
            completion_tokens += last.num_tokens
            body_choices.append({"index": index, "text": "".join(p.text for p in parts),
                                 "logprobs": None, "finish_reason": last.finish_reason,
                                 "stop_reason": last.stop_reason})
        return {"id": rid, "object": "text_completion", "created": _now(), "model": model,
                "choices": body_choices, "usage": _usage(groups, completion_tokens)}

    async def _stream(self, rid, model, req, groups):
        queue: asyncio.Queue = asyncio.Queue()
        tokens: dict[int, int] = {}
        tasks = [asyncio.create_task(self._pump(rid, req, g, queue)) for g in groups]
        created = _now()
        try:
            for _ in range(len(groups)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        yield sse_error(*_status_of(item))
                        yield "data: [DONE]\n\n"
                        return
                    tokens[item.index] = item.num_tokens
                    yield _chunk(rid, created, model, item)
            if req.stream_options and req.stream_options.include_usage:
                usage = _usage(groups, sum(tokens.values()))
                yield sse_data({"id": rid, "object": "text_completion", "created": created,
                                "model": model, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:  # a client that went away: abort whatever still runs
                t.cancel()

    async def _pump(self, rid, req, group: PromptGroup, queue: asyncio.Queue):
        try:
            await self._run_prompt(rid, req, group, queue.put)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put(exc)


async def _gather_or_raise(coros) -> None:
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    except (ValueError, EngineDeadError) as exc:
        raise APIError(*_status_of(exc)) from exc
    finally:
        for t in tasks:
            t.cancel()


def _status_of(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, ValueError):
        return 400, str(exc)
    if isinstance(exc, EngineDeadError):
        return 503, str(exc)
    return 500, f"internal error: {type(exc).__name__}"


def _chunk(rid: str, created: int, model: str, d: ChoiceDelta) -> str:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": d.index, "text": d.text, "logprobs": None,
                         "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]}
    return sse_data(body)


def _usage(groups: list[PromptGroup], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(g.prompt_ids) for g in groups)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _now() -> int:
    return int(time.time())
