"""What the client measures for one request. Times are seconds since the request was
sent; chunk_times holds the chunks that carried tokens (every chunk with a choice but
a chat's role-only opening one)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    success: bool = False
    ttft: float = 0.0  # first chunk with tokens
    e2el: float = 0.0  # end of the stream
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each chunk carried
    output_tokens: int = 0  # the usage chunk's completion_tokens, else sum(chunk_tokens)
    prompt_tokens: int = 0  # the usage chunk's prompt_tokens, else the requested length
    error: str = ""
    answer: str = ""  # the text, which a conversation's next turn builds on

    def itls(self) -> list[float]:
        """Gaps between output chunks. A chunk that carries k tokens adds k gaps of
        gap/k, so the ITLs of a request add up to e2el - ttft whatever the chunking."""
        out = []
        for i in range(1, len(self.chunk_times)):
            k = max(1, self.chunk_tokens[i])
            out.extend([(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k)
        return out

    def tpot(self) -> float | None:
        """vLLM's time per output token after the first; None for one-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)
