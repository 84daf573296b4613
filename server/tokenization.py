"""Tokenizing and chat-template rendering off the event loop.

Tokenizing a large prompt takes seconds (5 MB: about 6 s on 2 cores), and on the
event loop that would stall every stream, /health and /metrics with it. The work
goes to one worker thread, as vLLM's async tokenizer does: one, because a Hugging
Face tokenizer is not safe to use from several threads at once ("Already borrowed"
when one call changes its truncation settings under another), and the Rust
tokenizer releases the GIL while it runs, so the loop keeps its core. Before that, a
text that cannot fit the context whatever it tokenizes to is refused at once
(server/prompt_length.py)."""
from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvserve.server.errors import APIError
from kvserve.server.prompt_length import token_bound

T = TypeVar("T")


class Tokenization:
    """One tokenizer and the one thread that uses it. The server has two: one for
    generation prompts, one (with a copy of the tokenizer: `copy()`) for /tokenize and
    /detokenize, so that those can never delay a prompt."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bound = token_bound(tokenizer) if tokenizer is not None else None
        self._worker = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix="kvserve-tokenizer")

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the tokenizer's thread; what it raises is raised here."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._worker, call)

    def refuse_if_too_long(self, text: str, param: str) -> None:
        """400 for a text that needs at least the whole context, found without
        tokenizing it: the refusal the engine gives a prompt of max_model_len
        tokens or more."""
        if self.bound is None or len(text) < self.max_model_len:
            return
        least = self.bound.min_tokens(text)
        if least >= self.max_model_len:
            raise APIError(400, f"the prompt has at least {least} tokens ({len(text)} "
                           f"characters, and no token of this model covers more than "
                           f"{self.bound.chars_per_token}) but this model's maximum "
                           f"context length is {self.max_model_len} tokens", param)

    def copy(self) -> "Tokenization":
        """Another thread with a tokenizer of its own (a deep copy: the same vocabulary
        and settings, never borrowed by this one's thread)."""
        tokenizer = copy.deepcopy(self.tokenizer) if self.tokenizer is not None else None
        return Tokenization(tokenizer, self.max_model_len)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
