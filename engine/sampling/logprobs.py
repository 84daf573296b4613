"""Raw logprobs, as vLLM v1 returns by default: log_softmax of the model's logits
before temperature, penalties, logit_bias, min-p and top-k/p, in float32.

Each group of rows becomes one [rows, 2 + 2k] float32 block on the device: the chosen
token's logprob, its rank, then the top k ids and their logprobs. HostTransfer packs
every block of a step (and the sampled tokens) into one tensor and one .tolist(),
started early and read late (see HostTransfer)."""
from __future__ import annotations

import torch

from kvserve.engine.platform.outputs import TokenLogprob

# Token ids and ranks travel as float32, exact below 2**24.
MAX_EXACT_ID = 2**24


def logprob_block(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logprobs: [L, V] (log_softmax of raw logits); token_ids: [L] the tokens whose
    logprob and rank are wanted. Returns [L, 2 + 2k] float32."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    # vLLM's rank: how many tokens are at least as likely (itself included).
    rank = (logprobs >= chosen).sum(dim=1, keepdim=True)
    top = logprobs.topk(k, dim=1)
    return torch.cat([chosen, rank.float(), top.indices.float(), top.values], dim=1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(dim=-1)


def decode_block(values: list[float], token_ids: list[int], ks: list[int],
                 width_k: int) -> list[TokenLogprob]:
    """Host side of logprob_block: one TokenLogprob per row, row i keeping its top
    ks[i] (<= width_k, the k the block was built with)."""
    width = 2 + 2 * width_k
    out = []
    for i, (token, k) in enumerate(zip(token_ids, ks)):
        row = values[i * width:(i + 1) * width]
        ids = row[2:2 + k]
        lps = row[2 + width_k:2 + width_k + k]
        out.append(TokenLogprob(token, row[0], int(row[1]),
                                [(int(t), lp) for t, lp in zip(ids, lps)]))
    return out


class HostTransfer:
    """Collects device tensors and brings them all to the host as one tensor.

    start() begins the copy (on CUDA into pinned memory, without waiting for the
    device), fetch() waits for it and returns the parts as lists. Between the two
    the host is free: async scheduling plans the next step there. Integer parts
    stay integers when nothing else travels (the common step: tokens and flags)."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None
        self._event = None
        self._fetched: list[list] | None = None

    def add(self, tensor: torch.Tensor) -> int:
        self._parts.append(tensor.reshape(-1))
        return len(self._parts) - 1

    def start(self) -> None:
        if not self._parts or self._host is not None:
            return
        exact = all(not p.is_floating_point() for p in self._parts)
        flat = torch.cat([p if exact else p.float() for p in self._parts])
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def fetch(self) -> list[list]:
        """The parts, in the order added (read once; later calls reuse it)."""
        if self._fetched is None:
            self.start()
            if self._event is not None:
                self._event.synchronize()
            flat = self._host.tolist() if self._host is not None else []
            self._fetched, at = [], 0
            for part in self._parts:
                self._fetched.append(flat[at:at + part.numel()])
                at += part.numel()
        return self._fetched
