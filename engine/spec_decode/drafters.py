"""Model drafters: before a step, they replace each speculating request's placeholder
drafts with greedy tokens from a cheaper model, one batched pass per draft position,
writing that model's KV into the step's lookahead slots (the scheduler reserved them).
A greedy draft is a deterministic proposal, so the rejection rule stays exact
whatever the draft's quality; a better draft is only accepted more often.

- EarlyExitDrafter: the target's own first K layers, final norm and LM head. Those
  layers' KV at the draft positions is rewritten by the verification pass from the
  same tokens, so the cache never keeps a draft's value. No weights of its own.
- DraftModelDrafter (`--speculative-model`): a smaller model with the same
  vocabulary and its own KV cache, paged by the target's block tables (same block
  ids, its own tensors). It also runs over every step's whole batch, so its cache
  holds every token the target's does (prefix hits and forks included)."""
from __future__ import annotations

import torch

from kvserve.engine.kernels.attention import clear_attention_context, set_attention_context
from kvserve.engine.kernels.attention.step_metadata import build_host_step
from kvserve.engine.models.kv_caches import KVCacheFormat, attach_kv_caches
from kvserve.scheduler.output import ScheduledRequest


class GreedyDrafter:
    """The loop both drafters share; subclasses say which forward pass drafts."""
    observes_batches = False  # must see every step's batch (its own KV cache)

    def __init__(self, model, attn_backend, block_size: int, device: torch.device):
        self.model = model  # the model whose LM head turns hidden states into drafts
        self.attn_backend, self.block_size, self.device = attn_backend, block_size, device

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def observe(self, batch) -> None:
        """The step's flat batch, after the target ran it (drafters with a cache)."""

    @torch.inference_mode()
    def fill(self, items: list[ScheduledRequest]) -> None:
        """Replaces each item's placeholder drafts with this drafter's tokens."""
        drafts: list[list[int]] = [[] for _ in items]
        tokens = [s.request.token_ids[s.start] for s in items]
        for j in range(max(len(s.spec_token_ids) for s in items)):
            # Only requests with a slot reserved at this position take part.
            active = [i for i, s in enumerate(items) if len(s.spec_token_ids) > j]
            nxt = self._next_tokens([items[i] for i in active], [tokens[i] for i in active], j)
            for i, token in zip(active, nxt):
                drafts[i].append(token)
                tokens[i] = token
        for s, row in zip(items, drafts):
            s.spec_token_ids = row

    def _next_tokens(self, items: list[ScheduledRequest], tokens: list[int],
                     offset: int) -> list[int]:
        host = build_host_step([s.start + offset for s in items], [1] * len(items),
                               [s.block_table for s in items], self.block_size)
        positions, common, (ids,) = host.to_device(self.device, [torch.tensor(tokens)])
        set_attention_context(self.attn_backend, self.attn_backend.prepare(common))
        try:
            hidden = self.hidden(ids, positions)
        finally:
            clear_attention_context()
        # One host sync per draft position: the next pass needs the tokens anyway.
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


class EarlyExitDrafter(GreedyDrafter):
    def __init__(self, model, attn_backend, block_size: int, device: torch.device,
                 num_layers: int):
        super().__init__(model, attn_backend, block_size, device)
        total = model.config.num_layers
        self.num_layers = num_layers or max(1, total // 4)
        if not 1 <= self.num_layers < total:
            raise ValueError(f"draft_layers must be in 1..{total - 1}")

    def hidden(self, ids, positions):
        return self.model(ids, positions, num_layers=self.num_layers)


class DraftModelDrafter(GreedyDrafter):
    observes_batches = True

    def __init__(self, draft, num_blocks: int, attn_backend, block_size: int,
                 device: torch.device, kv_format: KVCacheFormat):
        super().__init__(draft, attn_backend, block_size, device)
        # Its own tensors, indexed by the target's block ids (same tables).
        self.kv_caches = attach_kv_caches(draft, num_blocks, block_size, kv_format, device)

    def hidden(self, ids, positions):
        return self.model(ids, positions)

    @torch.inference_mode()
    def observe(self, batch) -> None:
        set_attention_context(self.attn_backend, batch.attention)
        try:
            self.model(batch.input_ids, batch.positions)
        finally:
            clear_attention_context()
