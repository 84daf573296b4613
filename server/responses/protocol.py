"""POST /v1/responses bodies (pydantic), and what of the Responses API kvserve
refuses: OpenAI's hosted features (built-in tools, files, background runs, stored
prompts and conversations) that a local server cannot give, each a 400 naming the
field instead of an answer that silently lacks it."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, field_validator

from kvserve.server.errors import APIError
from kvserve.server.protocol import OpenAIRequest

# include: values that ask for nothing we would leave out. Reasoning comes back as
# plain reasoning_text content, so there is never encrypted content to include.
INCLUDABLE = {"reasoning.encrypted_content"}
# OpenAI's limits on `metadata`: pairs, key and value characters.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ...}: handed to the template
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)
    # kvserve's (as vLLM's extras): reproducible sampling and template arguments
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_within_openai_limits(cls, metadata):
        """OpenAI's limits: it is kept with a stored response, for a day by default."""
        if metadata is None:
            return None
        if len(metadata) > METADATA_PAIRS:
            raise ValueError(f"metadata may have at most {METADATA_PAIRS} pairs, got "
                             f"{len(metadata)}")
        for key, value in metadata.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys may have at most {METADATA_KEY_CHARS} "
                                 f"characters, got {len(key)}")
            if len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"metadata values may have at most {METADATA_VALUE_CHARS}"
                                 f" characters, got {len(value)} (key {key!r})")
        return metadata


def refuse_hosted_features(req: ResponsesRequest) -> None:
    """A 400 for the first field asking for something only OpenAI's platform has."""
    extra = req.model_extra or {}
    for name in ("conversation", "prompt"):
        if extra.get(name):
            _refuse(name, f"`{name}` (stored {name}s) is not supported by this server; "
                    "send the conversation as `input`, or chain with previous_response_id")
    if req.background:
        _refuse("background", "background responses are not supported by this server; "
                "use stream: true for long generations")
    if req.truncation == "auto":
        _refuse("truncation", "truncation \"auto\" is not supported: a conversation "
                "longer than the context is a 400, never cut silently")
    if req.top_logprobs:
        _refuse("top_logprobs", "top_logprobs are not supported on /v1/responses yet; "
                "use /v1/chat/completions with logprobs")
    if req.max_tool_calls is not None:
        _refuse("max_tool_calls", "max_tool_calls is not supported by this server")
    for value in req.include or ():
        if value not in INCLUDABLE:
            _refuse("include", f"include {value!r} is not supported by this server (it "
                    "asks for the output of a built-in tool or an image kvserve does "
                    "not have)")


def _refuse(param: str, message: str):
    raise APIError(400, message, param, "unsupported_parameter")


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"
