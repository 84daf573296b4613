"""POST /v1/messages and /v1/messages/count_tokens bodies (pydantic), as Anthropic
documents them, and what of the Messages API kvserve refuses: Anthropic's hosted
features (containers, MCP servers, context management, structured output formats)
and any field it does not know, each a 400 naming the field, never an answer that
silently lacks what was asked. Hints that leave the output as it is pass:
`cache_control` (kvserve caches every prompt's prefix by itself), `service_tier`,
`metadata`, `inference_geo`, `diagnostics`, `speed`. temperature, top_p and top_k,
which Anthropic's newest SDKs no longer type, are still read when sent.

Content blocks are read by server/anthropic/inputs.py, which names the block at fault."""
from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.errors import APIError
from kvserve.server.protocol import SamplingFields


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]  # Anthropic has no system turn: `system` is a field
    content: str | list[Any]  # blocks: read by inputs.py, which names the one at fault


class AnthropicRequest(BaseModel):
    """What both routes read: the conversation and what shapes its prompt."""
    model_config = ConfigDict(extra="allow")  # each extra is judged by refuse_extras
    model: str | None = None  # Anthropic requires it; absent here means the served model
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[Any] | None = None  # a string, or text blocks
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"effort": ...}; `format` is refused
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: ignored
    # vLLM's chat_template_kwargs, as chat and Responses take them (server/chat_template.py)
    chat_template_kwargs: dict[str, Any] | None = None

    allowed_extras: ClassVar[frozenset[str]] = frozenset()  # a route's own, beyond its fields


class CountTokensRequest(AnthropicRequest):
    pass


# vLLM's sampling extras (seed, min_p, penalties, logit_bias, ignore_eos, ...) pass
# through as they do on chat and Responses; what Anthropic names itself, or what has
# no meaning here (n choices, token ids, chat stream options, stop strings kept in the
# text), does not.
SAMPLING_EXTRAS = frozenset(SamplingFields.model_fields) - {
    "model", "temperature", "top_p", "top_k", "n", "stop", "stream", "stream_options",
    "user", "return_token_ids", "include_stop_str_in_output", "skip_special_tokens"}


class MessagesRequest(AnthropicRequest):
    # required, as Anthropic has it; 0 (Anthropic's cache warm-up) is not served
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # {"user_id": ...}: abuse tracking, ignored
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

    allowed_extras: ClassVar[frozenset[str]] = SAMPLING_EXTRAS

    def stop_strings(self) -> list[str]:
        """For the count caps (server/request_caps.py), which a big body meets on the
        JSON reader's thread already (server/json_body.py)."""
        return [s for s in self.stop_sequences or () if s]


# Anthropic's fields that ask for what kvserve has not: why each is refused.
_HOSTED = {
    "container": "containers belong to Anthropic's code execution tools, which this "
                 "server does not have",
    "mcp_servers": "the MCP connector is not supported by this server; run the MCP "
                   "client yourself and pass its tools as custom tools",
    "context_management": "context management (clearing old tool results or thinking) "
                          "is not supported by this server; trim the conversation "
                          "yourself",
}
# Anthropic's fields that change nothing here: accepted whatever their value (where
# inference runs, cache diagnostics, the fast tier, who the caller is on Anthropic's
# side).
_HINTS = frozenset({"inference_geo", "diagnostics", "speed", "user_profile_id",
                    "workspace_id"})


def refuse_extras(req: AnthropicRequest) -> None:
    """400 for a hosted feature, an unknown field, or an output_config.format."""
    for name, value in (req.model_extra or {}).items():
        if name in _HINTS or name in req.allowed_extras:
            continue
        if name in _HOSTED:
            if value in (None, [], {}):
                continue
            _refuse(name, f"`{name}`: {_HOSTED[name]}")
        _refuse(name, f"`{name}` is not a field this server knows on {_route(req)}; "
                "leave it out")
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        _refuse("output_config.format", "output_config.format (structured outputs) is not "
                "supported on /v1/messages yet; use /v1/chat/completions with "
                "response_format, or a tool with tool_choice {\"type\": \"tool\"}")
    unknown = set(req.output_config or {}) - {"effort", "format"}
    if unknown:
        _refuse("output_config", f"output_config.{sorted(unknown)[0]} is not supported by "
                "this server")


def _route(req: AnthropicRequest) -> str:
    return ("/v1/messages/count_tokens" if isinstance(req, CountTokensRequest)
            else "/v1/messages")


def _refuse(param: str, message: str):
    raise APIError(400, message, param, "unsupported_parameter")


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
