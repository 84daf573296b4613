"""Chat messages -> prompt token ids through the model's own chat template.

As vLLM does, the template is rendered to text and the text is then tokenized without
adding special tokens again (the template already writes BOS and turn markers)."""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import jinja2
import jinja2.meta

from kvserve.server.errors import APIError, no_tokenizer
from kvserve.server.tool_formats import ToolFormat
from kvserve.server.tools import for_template
from kvserve.server.validation import encode_text


def message_text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which we take the text ones."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise APIError(400, f"content parts of type {kind!r} are not supported "
                           "(only 'text')", "messages")
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def refuse_untrusted_template(template: str | None, kwargs: dict | None,
                              trusted: bool) -> None:
    """A template sent with the request runs on the server: only with
    --trust-request-chat-template (vLLM's rule)."""
    if not trusted and (template or (kwargs or {}).get("chat_template")):
        raise APIError(400, "Chat template is passed with request, but "
                       "--trust-request-chat-template is not set. Refused request with "
                       "untrusted chat template.", "chat_template")


# `{% generation %}` blocks: transformers' own tag (its AssistantTracker), unknown to a
# plain Jinja parser; the variables inside are the template's all the same.
_GENERATION_TAGS = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


@functools.lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from outside (empty if it cannot be parsed
    here: then no request argument reaches it)."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        parsed = env.parse(_GENERATION_TAGS.sub("", template))
    except jinja2.TemplateSyntaxError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


def template_kwargs(tokenizer, template: str, kwargs: dict | None) -> dict:
    """chat_template_kwargs the template itself reads (as vLLM keeps them), none of
    them a parameter of apply_chat_template's own (`tokenize`, `return_dict`,
    `tokenizer_kwargs`, ... would change what rendering returns or does)."""
    if not kwargs:
        return {}
    own = inspect.signature(tokenizer.apply_chat_template).parameters
    wanted = template_variables(template)
    return {k: v for k, v in kwargs.items() if k in wanted and k not in own}


def render_chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     chat_template: str | None = None,
                     chat_template_kwargs: dict | None = None,
                     tools: list[dict] | None = None,
                     tool_format: ToolFormat | None = None) -> str:
    if tokenizer is None:
        raise no_tokenizer("messages")
    if add_generation_prompt and continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both "
                       "be true", "continue_final_message")
    if not messages:
        raise APIError(400, "messages must not be empty", "messages")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be from "
                       "the assistant", "continue_final_message")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, "this model's tokenizer has no chat template; use "
                       "/v1/completions or pass `chat_template`", "messages")
    plain = [{**m, "content": message_text(m.get("content"))}
             for m in for_template(messages, tools, template, tool_format)]
    try:
        return tokenizer.apply_chat_template(
            plain, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template,
            **template_kwargs(tokenizer, template, chat_template_kwargs))
    except APIError:
        raise
    except Exception as exc:  # a template that rejects these messages (jinja raises)
        raise APIError(400, f"the chat template failed on these messages: {exc}",
                       "messages") from exc


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, **template_args) -> list[int]:
    """The prompt token ids of a conversation."""
    return chat_prompt_ids(tokenizer, render_chat_text(
        tokenizer, messages, add_generation_prompt, continue_final_message, **template_args))


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """A rendered conversation's token ids: the template wrote BOS and turn markers
    already, so none are added."""
    return encode_text(tokenizer, text, "messages", add_special_tokens=False)
