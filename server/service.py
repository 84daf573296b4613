"""What /v1/completions and /v1/chat/completions do around their own prompt handling:
check the model and the engine first, then run the prompt groups and answer as a
whole body or as a stream through the route's ResponseView."""
from __future__ import annotations

from fastapi.responses import JSONResponse, StreamingResponse

from engine.client.engine_client import EngineClient
from server import generation
from server.detokenizer import MAX_STOP_CHARS
from server.errors import APIError
from server.generation import PromptGroup, TextOptions
from server.config import ServerConfig
from server.grammar_limits import GrammarLimits
from server.request_owners import ENGINE_ID_HEADER, engine_request_id
from server.response_view import ResponseView
from server.tokenization import Tokenization
from server.unsupported_fields import Harmless, refuse_unsupported
from server.validation import check_model, lora_of


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
        """The model name to answer with; 404 for an unknown one, 400 past --max-n,
        --max-stop-strings or --max-logit-bias, or for a field this route does not
        support yet (server/unsupported_fields.py),
        503 (a status, not an error inside a 200 stream) when the engine is down."""
        model = check_model(req.model, self.model_names, self.engine.adapters.served)
        refuse_unsupported(req, self.unsupported_fields)
        if req.n > self.config.max_n:
            raise APIError(400, f"n must be at most {self.config.max_n} (--max-n), got "
                           f"{req.n}", "n")
        self._check_stop(req.stop_strings())
        bias = self.config.max_logit_bias
        if bias and len(req.logit_bias or ()) > bias:
            raise APIError(400, f"at most {bias} logit_bias entries (--max-logit-bias), got "
                           f"{len(req.logit_bias)}", "logit_bias")
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running")
        return model

    def _check_stop(self, stops: list[str]) -> None:
        """400 past --max-stop-strings stop strings or MAX_STOP_CHARS characters in
        one: each token's text is searched for them all on the event loop."""
        if len(stops) > self.config.max_stop_strings:
            raise APIError(400, f"at most {self.config.max_stop_strings} stop strings "
                           f"(--max-stop-strings), got {len(stops)}", "stop")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} "
                           f"characters, got one of {longest}", "stop")

    def text_options(self, req) -> TextOptions:
        return TextOptions(req.stop_strings(), req.include_stop_str_in_output,
                           req.skip_special_tokens, req.cache_salt, req.priority,
                           self.config.request_timeout, lora_of(self.engine, req.model))

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
