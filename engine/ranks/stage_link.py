"""How a step travels through the pipeline stages: point-to-point over
torch.distributed (gloo on CPU; on CUDA the sizes and metadata over a gloo group,
the activations over NCCL), from stage to stage in order. The engine (the last
stage) sends each step's metadata and token ids to the first stage; every stage
runs its layers and sends the metadata and its hidden states on; the stage before
the last sends the hidden states alone (the engine has the metadata). A stop goes
down the same chain.

Sends are asynchronous (isend): a stage hands a step on and starts the next one at
once, the engine launches up to P steps before it waits for the first. A send's
tensors are kept until it completes; each pair of stages receives in the order it
sent, so no step needs a tag."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.engine.kernels.attention.step_metadata import HostStep
from kvserve.engine.ranks import step_codec

STOP, FORWARD = 0, 1
_HEADER = 2 + step_codec.META_WORDS  # op, L (logit rows), the step's sizes


@dataclass
class StageStep:
    """A step as a stage receives it."""
    host: HostStep
    copies: list[tuple[int, int, int]]
    inputs: torch.Tensor  # the first stage's token ids [T], else hidden states [T, H]
    logit_rows: torch.Tensor  # [L] on the host: the last stage's ranks take logits there


class StageLink:
    """cpu_group: a gloo group of every stage for the sizes and the metadata (None:
    the default group is gloo, on CPU); device tensors go over the default group."""

    def __init__(self, device: torch.device, block_size: int, hidden_size: int,
                 dtype: torch.dtype, cpu_group=None):
        self.device, self.block_size = device, block_size
        self.hidden_size, self.dtype = hidden_size, dtype
        self.cpu_group = cpu_group
        self._sending: deque[tuple[list, list[torch.Tensor]]] = deque()

    def _isend(self, dst: int, host: list[torch.Tensor], on_device: list[torch.Tensor]
               ) -> None:
        while self._sending and all(w.is_completed() for w in self._sending[0][0]):
            self._sending.popleft()
        works = [dist.isend(t, dst, group=self.cpu_group) for t in host]
        works += [dist.isend(t, dst) for t in on_device]
        self._sending.append((works, host + on_device))

    def send_step(self, dst: int, host: HostStep, copies: list[tuple[int, int, int]],
                  inputs: torch.Tensor, logit_rows: torch.Tensor) -> None:
        meta, parts = step_codec.encode(host, copies)
        header = torch.tensor([FORWARD, len(logit_rows), *meta], dtype=torch.int64)
        payload = torch.cat([*parts, logit_rows.cpu()])
        self._isend(dst, [header, payload], [inputs.contiguous()])

    def send_hidden(self, dst: int, hidden: torch.Tensor) -> None:
        self._isend(dst, [], [hidden.contiguous()])

    def send_stop(self, dst: int) -> None:
        self._isend(dst, [torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64)],
                    [])

    def receive_step(self, src: int, token_ids: bool) -> StageStep | None:
        """The next step from `src`, its inputs token ids (the first stage's) or hidden
        states; None when the engine stops."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(header, src, group=self.cpu_group)
        op, num_rows, *meta = header.tolist()
        if op == STOP:
            return None
        lengths = step_codec.sizes(meta) + [num_rows]
        payload = torch.empty(sum(lengths), dtype=torch.int64)
        dist.recv(payload, src, group=self.cpu_group)
        *parts, logit_rows = payload.split(lengths)
        host, copies = step_codec.decode(meta, parts, self.block_size)
        t = meta[0]
        inputs = (torch.empty(t, dtype=torch.long, device=self.device) if token_ids else
                  torch.empty(t, self.hidden_size, dtype=self.dtype, device=self.device))
        dist.recv(inputs, src)
        return StageStep(host, copies, inputs, logit_rows)

    def receive_hidden(self, src: int, num_tokens: int) -> torch.Tensor:
        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype,
                             device=self.device)
        dist.recv(hidden, src)
        return hidden

    def drain(self) -> None:
        """Waits for every send still on its way."""
        while self._sending:
            for work in self._sending.popleft()[0]:
                work.wait()
