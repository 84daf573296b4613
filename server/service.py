"""What /v1/completions and /v1/chat/completions do around their own prompt handling:
check the model and the engine first, then run the prompt groups and answer as a
whole body or as a stream through the route's ResponseView."""
from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server import generation
from kvserve.server.background import in_background
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError
from kvserve.server.generation import PromptGroup, TextOptions
from kvserve.server.grammar_limits import GrammarLimits
from kvserve.server.request_caps import refuse_past_counts
from kvserve.server.request_owners import ENGINE_ID_HEADER, engine_request_id
from kvserve.server.response_view import ResponseView
from kvserve.server.tokenization import Tokenization
from kvserve.server.tracing import note
from kvserve.server.unsupported_fields import Harmless, refuse_unsupported
from kvserve.server.validation import check_model, lora_of


class GenerationService:
    unsupported_fields: dict[str, Harmless] = {}  # a route's own (unsupported_fields.py)

    def __init__(self, engine: EngineClient, model_names: list[str], tokenization: Tokenization,
                 config: ServerConfig):
        self.engine = engine
        self.tokenization = tokenization
        self.model_names = model_names
        self.vocab_size = engine.vocab_size
        self.config = config
        self.grammar_limits = GrammarLimits.of(config)

    def served_model(self, req) -> str:
        """The model name to answer with; 404 for an unknown one, 400 past a count cap
        (server/request_caps.py) or for a field this route does not support yet
        (server/unsupported_fields.py), 503 (a status, not an error inside a 200
        stream) when the engine is down."""
        model = check_model(req.model, self.model_names, self.engine.adapters.served)
        note(model=model)  # the request's span (server/tracing.py), when traced
        refuse_unsupported(req, self.unsupported_fields)
        refuse_past_counts(req, self.config)
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running")
        return model

    def text_options(self, req) -> TextOptions:
        return TextOptions(req.stop_strings(), req.include_stop_str_in_output,
                           req.skip_special_tokens, req.cache_salt, req.priority,
                           self.config.request_timeout, lora_of(self.engine, req.model),
                           in_background())

    async def respond(self, view: ResponseView, groups: list[PromptGroup], req):
        opts = self.text_options(req)
        engine_id = engine_request_id()
        headers = {ENGINE_ID_HEADER: engine_id}
        if req.stream:
            events = generation.stream(self.engine, engine_id, groups, opts)
            return StreamingResponse(view.sse(events), media_type="text/event-stream",
                                     headers=headers)
        results = await generation.collect(self.engine, engine_id, groups, opts)
        return JSONResponse(view.body(results), headers=headers)
