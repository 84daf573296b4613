"""The server's settings (everything of `kvserve serve` that is not the engine's):
each one a field declared once, its flag and KVSERVE_* variable made from it
(engine/config/settings.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.config.arg_types import non_negative, parse_bool, positive_int
from kvserve.engine.config.settings import setting
from kvserve.scheduler.sampling_params import POOLING_METHODS
from kvserve.server.reasoning import PARSER_CHOICES as REASONING_PARSERS
from kvserve.server.tool_formats import PARSER_CHOICES

DEFAULT_MAX_BODY_BYTES = 10 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = setting(None, "name(s) clients use, comma-separated")
    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(8000, "port to bind", parse=int)
    engine_mode: str = setting(
        "auto", "where the engine runs: a thread of the server, or a process of its own "
        "(auto: a process)", choices=["auto", "thread", "process"])
    headless: bool = setting(
        False, "serve no HTTP: run this node's tensor-parallel ranks for node 0's "
        "engine (--nnodes, --node-rank above 0) until it stops", parse=parse_bool)
    log_level: str = setting("info", "debug|info|warning|error")
    api_keys: list[str] = setting(
        help="require `Authorization: Bearer <key>` on /v1 routes; comma-separated "
        "and/or repeated for several keys", flag="--api-key", secret_list=True,
        default_factory=list)
    admin_api_keys: list[str] = setting(
        help="keys that also see the engine's request ids on /v1/engine/stream (the "
        "operator's: with --api-key set, other keys see requests without ids; with no "
        "key at all, everyone does); comma-separated and/or repeated",
        flag="--admin-api-key", secret_list=True, default_factory=list)
    protect_metrics: bool = setting(
        False, "require the API key on /health, /ready, /version and /metrics too (needs "
        "--api-key; probes and scrapers must then send it)", parse=parse_bool)
    max_waiting_requests: int = setting(
        0, "answer 429 to new generation requests while this many wait to be scheduled "
        "(0: no limit)", parse=non_negative(int))
    max_waiting_tokens: int = setting(
        0, "answer 429 to new generation requests while the prompts waiting to be "
        "scheduled (queued, not yet prefilled) hold this many tokens (0: no limit)",
        parse=non_negative(int))
    max_request_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "answer 413 to a request body larger than this (0: no "
        "limit)", parse=non_negative(int))
    body_read_timeout: float = setting(
        30.0, "seconds a request body may take to arrive, whole; a slower one is a 408 "
        "and its connection is closed (0: no limit)", parse=non_negative(float))
    max_connections: int = setting(
        4096, "most HTTP connections (and requests on them) served at once; past it a "
        "new one gets 503 (uvicorn's limit_concurrency; 0: no limit)",
        parse=non_negative(int))
    max_prompts_per_request: int = setting(
        1024, "most prompts in one /v1/completions list prompt (0: no limit)",
        parse=non_negative(int))
    max_n: int = setting(16, "most choices (`n`) one request may ask for", parse=positive_int)
    max_choices_per_request: int = setting(
        1024, "most sequences one /v1/completions request may run: its prompts times n "
        "(0: no limit; --max-prompts-per-request x --max-n alone allow 16,384)",
        parse=non_negative(int))
    max_logit_bias: int = setting(
        300, "most `logit_bias` entries one request may give (OpenAI's limit is 300); "
        "each is applied to every step's logits", parse=non_negative(int))
    max_stop_strings: int = setting(
        64, "most stop strings (`stop`) one request may give, each at most 256 "
        "characters (OpenAI allows 4): every token's text is searched for them, on "
        "the server's event loop", parse=positive_int)
    # server/grammar_limits.py: checked before a spec is parsed (off the event loop)
    # or compiled; OpenAI's own limits and the measured parse costs are noted there.
    max_grammar_spec_bytes: int = setting(
        512 << 10, "most bytes of one structured output's spec as JSON (a schema, a "
        "grammar, a regex, a structural tag, the choices) or of the tools' parameter "
        "schemas together (0: no limit)", parse=non_negative(int))
    max_grammar_spec_depth: int = setting(
        64, "most levels of nesting (objects and arrays) in a JSON schema, a "
        "structural tag or a tool's parameters: xgrammar's parse time grows "
        "faster than the depth (0: no limit)", parse=non_negative(int))
    max_tools: int = setting(
        128, "most `tools` one chat request may give (OpenAI's limit is 128) "
        "(0: no limit)", parse=non_negative(int))
    max_guided_choices: int = setting(
        1000, "most entries of a `choice` structured output (OpenAI allows 1000 enum "
        "values in a schema) (0: no limit)", parse=non_negative(int))
    max_regex_length: int = setting(
        16384, "most characters of a regex structured output, or of a `pattern` in a "
        "JSON schema (0: no limit)", parse=non_negative(int))
    request_timeout: float = setting(
        0.0, "seconds a generation request may run; then it is aborted and its choices "
        "end with finish reason \"abort\", keeping the text made so far (0: no limit)",
        parse=non_negative(float))
    timeout_keep_alive: float = setting(
        5.0, "seconds an idle HTTP keep-alive connection stays open (uvicorn's and "
        "vLLM's default: 5); a client pool that keeps idle connections as long or "
        "longer can send a request on one just as the server closes it",
        parse=non_negative(float))
    tool_call_parser: str = setting(
        "auto", "the format of tool calls a model writes with tool_choice \"auto\" "
        "(auto: read off the chat template; hermes for templates without tools)",
        choices=PARSER_CHOICES)
    trust_request_chat_template: bool = setting(
        False, "render a chat template sent with a request (`chat_template`); without "
        "it such a request is a 400, as in vLLM: a template is code the server runs",
        parse=parse_bool)
    reasoning_parser: str = setting(
        "none", "split a thinking model's <think>...</think> from its answer into "
        "reasoning_content (chat) and reasoning items (responses): deepseek_r1 (the "
        "output starts thinking), qwen3 (it thinks when it opens <think> or the "
        "prompt left one open)", choices=list(REASONING_PARSERS))
    pooling: str = setting(
        "last", "how /v1/embeddings pools a prompt's final hidden states: last (the "
        "last token's, as decoder embedding models such as Qwen3-Embedding are "
        "trained) or mean", choices=list(POOLING_METHODS))
    responses_store_max: int = setting(
        1024, "most responses /v1/responses keeps (store: true) for GET and "
        "previous_response_id, in memory: the oldest go first, a restart forgets them "
        "(0: keep none)", parse=non_negative(int))
    responses_store_bytes: int = setting(
        256 << 20, "most bytes the stored responses may hold together (their bodies and "
        "conversations as JSON): the oldest go first; a response larger than this alone "
        "is not stored (0: no limit)", parse=non_negative(int))
    responses_store_ttl: float = setting(
        86400.0, "seconds a stored response is kept", parse=non_negative(float))
    # vLLM's switch is VLLM_ALLOW_RUNTIME_LORA_UPDATING; this one's variable is
    # KVSERVE_ALLOW_RUNTIME_LORA_UPDATING.
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
        "--enable-lora; behind --api-key when one is set)", parse=parse_bool)
    lora_root: str | None = setting(
        None, "the directory runtime LoRA loads must come from: a `lora_path` is read "
        "under it (a relative one from it), never outside once links are resolved; "
        "unset, any path the server can read (as vLLM)")
    shutdown_timeout: float = setting(
        30.0, "seconds in-flight requests may run after SIGTERM/SIGINT before they are "
        "aborted", parse=non_negative(float))
    # vLLM's flag (server/tracing.py); vLLM sends OTLP over gRPC by default, this over
    # HTTP, so the URL is the collector's /v1/traces (port 4318), not its gRPC port.
    otlp_traces_endpoint: str | None = setting(
        None, "export an OpenTelemetry span per request (vLLM's attribute names; a "
        "traceparent header continues the caller's trace) over OTLP/HTTP to this URL, "
        "e.g. http://localhost:4318/v1/traces; needs pip install 'kvserve[otel]' "
        "(unset: no traces)")
    # /v1/files and /v1/batches (server/batch/)
    batch_dir: str | None = setting(
        None, "where /v1/files keeps files and /v1/batches its jobs, across restarts "
        "(unset: $KVSERVE_CACHE/batch)")
    files_store_bytes: int = setting(
        2 << 30, "most bytes the stored files (uploads and batch results) may hold "
        "together; past it an upload, or a batch's results, is refused with 507 (0: no "
        "limit)", parse=non_negative(int))
    max_upload_bytes: int = setting(
        200 << 20, "answer 413 to a file upload (POST /v1/files) larger than this "
        "(OpenAI's limit for batch files: 200 MB); uploads stream to disk (0: no limit)",
        parse=non_negative(int))
    batch_concurrency: int = setting(
        32, "most lines of a batch job in the engine at once; they are scheduled after "
        "every interactive request", parse=positive_int)

    def __post_init__(self) -> None:
        if self.protect_metrics and not self.any_keys:
            raise ValueError("--protect-metrics needs --api-key (or KVSERVE_API_KEY)")
        if self.otlp_traces_endpoint is not None:
            _check_traces_endpoint(self.otlp_traces_endpoint)

    @property
    def any_keys(self) -> bool:
        """Whether requests need a key (any key, admin or not)."""
        return bool(self.api_keys or self.admin_api_keys)


def _check_traces_endpoint(url: str) -> None:
    """At start-up, before the engine: a URL, and the packages that export to it
    (looked for, not imported)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL (OTLP/HTTP), "
                         f"e.g. http://localhost:4318/v1/traces; got {url!r}")
    import importlib.util

    needed = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    try:
        missing = [m for m in needed if importlib.util.find_spec(m) is None]
    except ModuleNotFoundError:  # not even the opentelemetry namespace
        missing = list(needed)
    if missing:
        raise ValueError("--otlp-traces-endpoint needs the OpenTelemetry SDK and its "
                         "OTLP/HTTP exporter (missing: " + ", ".join(missing) + "): "
                         "pip install 'kvserve[otel]'")
