"""Reading one streamed OpenAI response (completions or chat) into a RequestRecord."""
from __future__ import annotations

from kvserve.benchmarks.client.records import RequestRecord


def chunk_text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def logprob_tokens(choice: dict, chat: bool) -> int | None:
    """How many tokens the chunk's logprobs cover, when it has any."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    entries = lp.get("content") if chat else lp.get("tokens")
    return len(entries) if entries else None


class StreamReader:
    """Feed it each parsed `data:` payload with its arrival time (seconds since the
    request was sent), then call finish()."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.record = RequestRecord()
        self.parts: list[str] = []
        self.usage: dict | None = None
        self.counted = 0  # tokens given to the chunks so far

    def feed(self, data: dict, now: float) -> None:
        if "error" in data:
            err = data["error"]
            self.record.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if data.get("usage"):
            self.usage = data["usage"]
        choices = data.get("choices") or []
        if choices and not self._role_only(choices[0]):
            self._output(choices[0], chunk_text(choices[0], self.chat), now)

    def _role_only(self, choice: dict) -> bool:
        """A chat's opening chunk (role, no content) is no token. Any other chunk is
        one, even without text: its tokens' text may be held back or skipped."""
        delta = choice.get("delta") or {}
        return self.chat and "role" in delta and not delta.get("content")

    def _output(self, choice: dict, text: str, now: float) -> None:
        rec = self.record
        if not rec.chunk_times:
            rec.ttft = now
        rec.chunk_times.append(now)
        k = self._tokens_in(choice)
        rec.chunk_tokens.append(k)
        self.counted += k
        self.parts.append(text)

    def _tokens_in(self, choice: dict) -> int:
        """Per-chunk usage (vLLM's continuous_usage_stats) is exact: the tokens it
        counts beyond those already given to earlier chunks; else logprobs; else one
        token per chunk, which is all a plain stream says. A usage that first comes
        on the last chunk (llama-server puts it on the finish chunk) is not that
        chunk's tokens: the earlier chunks have them already."""
        if self.usage and "completion_tokens" in self.usage:
            k = self.usage["completion_tokens"] - self.counted
            if k > 0:
                return k
        return logprob_tokens(choice, self.chat) or 1

    def finish(self, now: float, requested_input_len: int) -> RequestRecord:
        rec = self.record
        rec.e2el = now
        rec.answer = "".join(self.parts)
        usage = self.usage or {}
        rec.output_tokens = usage.get("completion_tokens") or sum(rec.chunk_tokens)
        rec.prompt_tokens = usage.get("prompt_tokens") or requested_input_len
        if not rec.error and not rec.chunk_times:
            rec.error = "the stream ended without any choice"
        rec.success = not rec.error
        return rec
