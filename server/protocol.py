"""OpenAI request bodies (pydantic). Unknown request fields are ignored with a log
line, as vLLM does, unless they would change the output (the generation routes
refuse those: server/unsupported_fields.py). Responses are plain dicts built where
they are sent."""
from __future__ import annotations

import logging
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

log = logging.getLogger("kvserve.server")

TokenIds = list[Annotated[int, Field(ge=0)]]
MAX_LOGPROBS = 20  # OpenAI's cap on top alternatives per token
MAX_CACHE_SALT = 128  # vLLM's cap on cache_salt's length
# Fields whose explicit null means their default (vLLM types them optional).
NULL_IS_DEFAULT = frozenset({"stream", "n", "echo", "logprobs", "return_token_ids",
                             "ignore_eos", "skip_special_tokens", "min_tokens",
                             "include_stop_str_in_output", "add_generation_prompt",
                             "continue_final_message", "speculative", "priority",
                             "use_beam_search", "length_penalty", "early_stopping"})
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class KVTransferParams(BaseModel):
    """vLLM's kv_transfer_params, what a P/D router (vllm-router
    --vllm-pd-disaggregation) passes between a prefill and a decode instance. Read
    only by a server run with --kv-transfer-config (engine/kv_transfer/); bounded so
    one request costs at most a few hundred KiB to parse."""
    model_config = ConfigDict(extra="ignore")
    do_remote_decode: bool = False  # to a prefill instance: keep the KV for a decode one
    do_remote_prefill: bool = False  # to a decode instance: read the KV from a prefill one
    remote_engine_id: str | None = Field(default=None, max_length=128)
    remote_host: str | None = Field(default=None, max_length=255)
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_block_ids: list[int] | None = Field(default=None, max_length=65536)
    transfer_id: str | None = Field(default=None, max_length=64)


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:
            log.info("ignoring unknown request fields: %s", sorted(self.model_extra))
        return self


class SamplingFields(OpenAIRequest):
    """What /v1/completions and /v1/chat/completions share."""
    model: str | None = None
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=0, ge=-1)
    min_p: float | None = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1)  # the upper bound is --max-n (server/config.py)
    # torch's generators take 64-bit seeds; a bigger one must not reach the engine
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    # Infinity is valid JSON to Python's parser: not a penalty (vLLM: finite)
    repetition_penalty: float | None = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # vLLM's: only these token ids may be sampled (checked against the vocabulary,
    # at most its size: server/validation.py)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated, each tokenized as it is and after a space
    # (server/validation.py); at most MAX_BAD_WORDS of MAX_BAD_WORD_CHARS each
    # (server/request_caps.py)
    bad_words: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = None
    # vLLM's: each choice also carries its token ids (and the prompt's); the only
    # output of a model served without a tokenizer
    return_token_ids: bool = False
    # lower is sooner, with --scheduling-policy priority
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: KVTransferParams | None = None
    # kvserve's: false opts this request out of speculative decoding (when the server
    # runs it); the output is the same either way, only its speed differs
    speculative: bool = True

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """An explicit null for a switch or a count is its default, as vLLM reads it
        (JavaScript and LangChain clients send nulls)."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data

    @field_validator("cache_salt")
    @classmethod
    def _salt_is_a_short_plain_string(cls, salt):
        if salt is None:
            return salt
        if not salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        if len(salt) > MAX_CACHE_SALT or any(c in salt for c in "@/\\\x00"):
            raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT} characters and "
                             "must not contain '@', '/', '\\' or NUL")
        try:
            salt.encode("utf-8")  # it is hashed with the prompt's blocks
        except UnicodeEncodeError:
            raise ValueError("cache_salt is not valid UTF-8 text") from None
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, bias):
        for key in bias or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return bias

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]  # "" would match at once: ignore it

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class BeamSearchFields(OpenAIRequest):
    """vLLM's beam search (server/beam_search.py): `n` is the beam width and the n best
    beams are the choices. Only the two generation routes have these (not SamplingFields:
    the Responses and Anthropic routes, which copy SamplingFields' extras, run no beams);
    without use_beam_search they are ignored, as vLLM ignores them."""
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    # vLLM v0's field, transformers' values (vLLM v1 has none: its default, False)
    early_stopping: bool | Literal["never"] = False

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping_value(cls, value):
        if value is True or value is False or value == "never":
            return value
        raise ValueError('early_stopping must be true, false or "never"')


class CompletionRequest(SamplingFields, BeamSearchFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False  # before max_tokens: its validator reads it
    # 0 only with echo: score the prompt without generating (lm-eval-harness does it)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: each prompt token's logprob, rank and top k (-1: the whole vocabulary),
    # range and stream checked in server/validation.py. Not a SamplingFields one: the
    # Responses and Anthropic routes copy those, and their output has no place for it.
    prompt_logprobs: int | None = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_max_tokens_needs_echo(cls, value, info: ValidationInfo):
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        return value

    @property
    def echo_only(self) -> bool:
        """The prompt back, with its logprobs, and nothing generated."""
        return self.echo and self.max_tokens == 0

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


class CalledFunction(OpenAIRequest):
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON string, as OpenAI sends it


class HistoryToolCall(OpenAIRequest):
    """An earlier assistant message's tool call, as a client sends the history back:
    templates (and tools.for_template) read function.name and .arguments."""
    id: str | None = None
    type: str = "function"
    function: CalledFunction


class ChatMessage(OpenAIRequest):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None


class ChatCompletionRequest(SamplingFields, BeamSearchFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = None  # as on CompletionRequest
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: handed to the template (gpt-oss reads it); "none" also turns thinking
    # off for templates with an enable_thinking switch, unless the request set it
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None

    def message_dicts(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
