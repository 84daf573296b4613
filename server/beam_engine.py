"""One prompt's beam search over the engine (server/beam_search.py): every step, each
live beam is one engine request of max_tokens 1 whose logprobs list its best next
tokens; the finished hypotheses become the prompt's choices, one delta each."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from kvserve.engine.platform.outputs import TokenLogprob
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.beam_algorithm import Beam, BeamSearch, BeamSpec, Candidates, Hypothesis
from kvserve.server.detokenizer import IncrementalDetokenizer
from kvserve.server.errors import APIError
from kvserve.server.generation import ChoiceDelta, PromptGroup, RequestFailedError, TextOptions
from kvserve.server.tracing import note

log = logging.getLogger("kvserve.server")


async def run_beam_group(engine, base_id: str, group: PromptGroup, opts: TextOptions,
                         spec: BeamSpec) -> list[ChoiceDelta]:
    """One prompt's search, each step one engine request per live beam; its `n` choices
    (ids prompt_index * n + rank), each as one finished delta."""
    params = group.params
    make_text = None
    if opts.stop and engine.tokenizer is not None:
        def make_text():
            return IncrementalDetokenizer(engine.tokenizer, group.prompt_ids, opts.stop,
                                          opts.include_stop_str_in_output,
                                          opts.skip_special_tokens)
    search = BeamSearch(params.n, params.max_tokens, spec.eos_ids, spec.stop_ids,
                        spec.length_penalty, spec.early_stopping, make_text)
    # The chosen tokens' own logprobs come from the same lists: as many as either needs.
    step = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, speculative=False,
                          logprobs=max(search.k, params.logprobs or 0))
    first = dataclasses.replace(step, prompt_logprobs=params.prompt_logprobs)
    note(request_id=base_id, lora=opts.lora_name, prompt_tokens=len(group.prompt_ids))
    head = None  # the first step's output: the prompt's cached tokens and logprobs
    cut = False
    try:
        async with asyncio.timeout(opts.timeout or None):
            while not search.done:
                outs = await _step(engine, f"{base_id}-{group.index}.{search.steps}", group,
                                   search.live, first if head is None else step, opts)
                if head is None:
                    head = outs[0]
                if any(o.finish_reason == "abort" or not o.logprobs for o in outs):
                    cut = True  # aborted in the engine (its page, a shutdown)
                    break
                search.step([o.logprobs[0].top for o in outs])
    except TimeoutError:
        log.info("request %s ran past --request-timeout (%gs): aborted", base_id, opts.timeout)
        cut = True
    hyps = search.cut_short() if cut else search.results()
    while len(hyps) < params.n:  # cut short before a beam had a token
        hyps.append(Hypothesis((), float("-inf"), float("-inf"), "abort"))
    return [_delta(engine.tokenizer, group, opts, rank, h, head)
            for rank, h in enumerate(hyps)]


async def _step(engine, step_id: str, group: PromptGroup, beams: list[Beam],
                params: SamplingParams, opts: TextOptions) -> list:
    """Each beam's one-token engine request, at once; their outputs in beam order.
    Ids `<request>-<prompt>.<step>.<beam>` keep the request's owner findable."""
    tasks = [asyncio.create_task(_one(engine, f"{step_id}.{i}", group,
                                      group.prompt_ids + list(beam.tokens), params, opts))
             for i, beam in enumerate(beams)]
    try:
        return await asyncio.gather(*tasks)
    finally:  # one failed (or we were cancelled): end the others
        for t in tasks:
            t.cancel()


async def _one(engine, request_id: str, group: PromptGroup, ids: list[int],
               params: SamplingParams, opts: TextOptions):
    last = None
    gen = engine.generate(request_id, ids, params, cache_salt=opts.cache_salt,
                          priority=opts.priority, lora_name=opts.lora_name,
                          background=getattr(opts, "background", False))
    async with contextlib.aclosing(gen):
        async for out in gen:
            last = out
    if last is None:
        raise RequestFailedError("the engine ended a beam's step without an output")
    if last.finish_reason == "error":
        if last.error_status is not None:
            raise APIError(last.error_status, last.error or "refused", group.grammar_param)
        raise RequestFailedError(last.error or "the engine failed this request")
    return last


def _delta(tokenizer, group: PromptGroup, opts: TextOptions, rank: int, h: Hypothesis,
           head) -> ChoiceDelta:
    """A hypothesis as its choice's one delta, its text made as a sampled sequence's
    (generation._Sequence): an ending token's text left out unless
    include_stop_str_in_output, cut at a stop string."""
    detok = IncrementalDetokenizer(tokenizer, group.prompt_ids, opts.stop,
                                   opts.include_stop_str_in_output, opts.skip_special_tokens)
    shown = h.tokens[:-1] if h.ended_by_token and not opts.include_stop_str_in_output \
        else h.tokens
    detok.add_tokens(list(shown))
    text = detok.flush(True)
    finish, stop_reason = h.finish_reason, h.stop_reason
    if detok.stop_reason is not None:
        finish, stop_reason = "stop", detok.stop_reason
    d = ChoiceDelta(group.choice_index(rank), text, finish, stop_reason,
                    num_tokens=len(h.tokens), token_ids=list(h.tokens), first=True)
    if group.params.logprobs is not None:
        d.logprobs = [_logprob(t, top, group.params.logprobs)
                      for t, top in zip(h.tokens, h.tops)]
    if head is not None:
        d.num_prompt_tokens, d.num_cached_tokens = head.num_prompt_tokens, head.num_cached_tokens
        d.prompt_logprobs = head.prompt_logprobs
    return d


def _logprob(token: int, top: Candidates, k: int) -> TokenLogprob:
    """The chosen token's entry from the list it was chosen from (it is in it: only
    listed tokens are candidates)."""
    logprob = next(lp for t, lp in top if t == token)
    rank = sum(1 for _, lp in top if lp >= logprob)
    return TokenLogprob(token, logprob, rank, list(top[:k]))
