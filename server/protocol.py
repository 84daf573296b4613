"""OpenAI request and response bodies (pydantic). Unknown request fields are ignored
with a log line, as vLLM does."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("kvserve.server")

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:
            log.info("ignoring unknown request fields: %s", sorted(self.model_extra))
        return self


class CompletionRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    # torch's generators take 64-bit seeds; a bigger one must not reach the engine
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = None
    priority: int = 0  # lower is sooner, with --scheduling-policy priority

    def prompts(self) -> list[str | list[int]]:
        """The prompt field in its four OpenAI forms, as a list of single prompts."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], list):
            return list(p)
        if p and isinstance(p[0], int):
            return [p]
        return list(p)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]  # "" would match at once: ignore it


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"
