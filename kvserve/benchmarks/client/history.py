"""How a session's next prompt is built: the previous turn's prompt, the answer the
server gave to it, then the new user message, as text (/v1/completions) or as chat
messages (/v1/chat/completions). With prefix caching, each turn's prompt starts with
everything the previous turn computed, which is what the conversation workload tests."""
from __future__ import annotations

from kvserve.benchmarks.client.datasets import Prompt

Messages = list[dict]


def first_prompt(message: Prompt, chat: bool) -> Prompt | Messages:
    return [{"role": "user", "content": message}] if chat else message


def next_prompt(previous: Prompt | Messages, answer: str, message: str,
                chat: bool) -> Prompt | Messages:
    if chat:
        return [*previous, {"role": "assistant", "content": answer},
                {"role": "user", "content": message}]
    return f"{previous}{answer}\n{message}"


def approx_len(prompt: Prompt | Messages) -> int:
    """Words or ids in a prompt: the input length when the server reports no usage."""
    if isinstance(prompt, str):
        return len(prompt.split())
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m["content"].split()) for m in prompt)
    return len(prompt)
