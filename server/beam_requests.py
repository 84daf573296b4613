"""A beam search request (use_beam_search, server/beam_search.py): what it asks for,
checked first (a 400 naming what beam search cannot honour, before any stream starts),
then every prompt searched (server/beam_engine.py) and answered whole or streamed."""
from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.scheduler.sampling_params import MAX_LOGPROBS
from kvserve.server.beam_algorithm import BeamSpec, candidates_per_beam, max_beam_width
from kvserve.server.beam_engine import run_beam_group
from kvserve.server.errors import APIError
from kvserve.server.generation import (EXPECTED_ERRORS, ChoiceDelta, PromptGroup, TextOptions,
                                       gather_or_fail, status_of)
from kvserve.server.metrics.frontend import current_clock
from kvserve.server.request_owners import ENGINE_ID_HEADER, engine_request_id

log = logging.getLogger("kvserve.server")


_NOT_WITH_BEAMS = (  # field, whether it is set: what would change logprobs beam search reads
    ("presence_penalty", lambda r: bool(r.presence_penalty)),
    ("frequency_penalty", lambda r: bool(r.frequency_penalty)),
    ("repetition_penalty", lambda r: r.repetition_penalty not in (None, 1.0)),
    ("logit_bias", lambda r: bool(r.logit_bias)),
    ("allowed_token_ids", lambda r: r.allowed_token_ids is not None),
    ("bad_words", lambda r: bool(r.bad_words)),
    ("min_tokens", lambda r: r.min_tokens > 0),
)


def beam_spec(req, groups: list[PromptGroup], engine) -> BeamSpec:
    """The request's search, or a 400 naming the field beam search cannot honour."""
    for name, is_set in _NOT_WITH_BEAMS:
        if is_set(req):
            raise APIError(400, f"`{name}` cannot be used with use_beam_search: beam search "
                           "ranks the model's own logprobs, which it would change", name)
    grammar = next((g for g in groups if g.params.structured is not None), None)
    if grammar is not None:
        param = grammar.grammar_param or "response_format"
        raise APIError(400, f"`{param}` cannot be used with use_beam_search: beam search "
                       "ranks the model's own logprobs, which a grammar does not "
                       "constrain", param)
    eos = frozenset() if req.ignore_eos else frozenset(engine.info.eos_token_ids)
    stop_ids = frozenset(req.stop_token_ids or ())
    most = max_beam_width(len(eos | stop_ids))
    if req.n > most:
        per = candidates_per_beam(len(eos | stop_ids))
        raise APIError(400, f"with use_beam_search, n is the beam width, and each step "
                       f"ranks {per} * n candidates by their logprobs, of which the engine "
                       f"returns at most {MAX_LOGPROBS} per token: n may be at most {most}, "
                       f"got {req.n}", "n")
    return BeamSpec(eos, stop_ids, req.length_penalty, req.early_stopping)


async def _collect(engine, base_id: str, groups: list[PromptGroup], opts: TextOptions,
                   spec: BeamSpec) -> dict[int, list[ChoiceDelta]]:
    done = await gather_or_fail([asyncio.create_task(
        run_beam_group(engine, base_id, g, opts, spec)) for g in groups])
    results = {d.index: [d] for deltas in done for d in deltas}
    current_clock().sent(d for ds in results.values() for d in ds)
    return results


async def _stream(engine, base_id: str, groups: list[PromptGroup], opts: TextOptions,
                  spec: BeamSpec):
    """generation.stream's shape: one batch, every choice, once the searches are over
    (an error instead: the status line is sent already)."""
    try:
        results = await _collect(engine, base_id, groups, opts, spec)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if not isinstance(exc, EXPECTED_ERRORS):
            log.error("internal error in a streaming beam search", exc_info=exc)
        yield [APIError(*status_of(exc))]
        return
    yield [d for i in sorted(results) for d in results[i]]


async def respond(service, view, groups: list[PromptGroup], req):
    """GenerationService.respond for a request with use_beam_search: checked first
    (a 400 before any stream starts), then searched, answered whole or streamed."""
    spec = beam_spec(req, groups, service.engine)
    opts = service.text_options(req)
    engine_id = engine_request_id()
    headers = {ENGINE_ID_HEADER: engine_id}
    if req.stream:
        events = _stream(service.engine, engine_id, groups, opts, spec)
        return StreamingResponse(view.sse(events), media_type="text/event-stream",
                                 headers=headers)
    results = await _collect(service.engine, engine_id, groups, opts, spec)
    return JSONResponse(view.body(results), headers=headers)
