"""Executes one scheduled step: copy-on-write block copies, a flat batch, the model's
forward pass over it, and sampling (with logprobs and prompt logprobs on request)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.context import (AttentionMetadata, DecodeBatch, PrefillSpan,
                                      set_attention_metadata)
from engine.models.llama import LlamaForCausalLM
from engine.sampling import Sampler, StepResult
from engine.sampling.logprobs import MAX_EXACT_ID
from engine.sampling.prompt_logprobs import PromptSpan
from scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    # [R + M]: the last row of each request that samples, then the M prompt rows
    # whose logits prompt logprobs need
    logit_rows: torch.Tensor
    sampling: list[ScheduledRequest]  # the R requests that sample, in row order
    prompt_spans: list[PromptSpan]  # where the M prompt rows come from


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.model, self.device, self.block_size = model, device, block_size
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(cfg.num_layers)]
        for layer, (k, v) in zip(model.layers, self.kv_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
        if cfg.vocab_size >= MAX_EXACT_ID:
            raise ValueError("vocabularies of 2**24 tokens or more are not supported")
        self.sampler = Sampler(device)

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Runs the step: the sampled token of every request that samples (a forking
        parent's siblings included) and the logprobs asked for."""
        self.copy_blocks(out.block_copies)
        batch = self.prepare(out.scheduled)
        logits = self.forward_logits(batch)
        if not batch.sampling and not batch.prompt_spans:
            return StepResult()
        return self.sampler.run(logits, batch.sampling, batch.prompt_spans)

    def forward_logits(self, batch: FlatBatch) -> torch.Tensor:
        set_attention_metadata(batch.attention)
        try:
            hidden = self.model(batch.input_ids, batch.positions)
        finally:
            set_attention_metadata(None)
        return self.model.compute_logits(hidden[batch.logit_rows])

    def copy_blocks(self, copies) -> None:
        for c in copies:
            for k, v in self.kv_caches:
                k[c.dst, :c.num_tokens] = k[c.src, :c.num_tokens]
                v[c.dst, :c.num_tokens] = v[c.src, :c.num_tokens]

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    # -- batch preparation -----------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest]) -> FlatBatch:
        ids, starts, lens = [], [], []
        for s in scheduled:
            ids.extend(s.request.token_ids[s.start:s.start + s.num_new_tokens])
            starts.append(s.start)
            lens.append(s.num_new_tokens)
        tables = _pad_tables([s.block_table for s in scheduled])
        positions, slots = self._positions_and_slots(starts, lens, tables)
        query_starts = [0]
        for n in lens:
            query_starts.append(query_starts[-1] + n)
        meta = AttentionMetadata(slot_mapping=slots, prefills=[], decodes=None,
                                 num_tokens=len(ids))
        self._attention_spans(meta, scheduled, tables, query_starts)
        sampling = [s for s in scheduled if s.samples]
        rows = [query_starts[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples]
        spans = self.sampler.prompt.plan(scheduled, query_starts)
        for span in spans:
            rows.extend(range(span.row, span.row + span.count))
        dev = self.device
        return FlatBatch(
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=positions, attention=meta,
            logit_rows=torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
            sampling=sampling, prompt_spans=spans)

    def _positions_and_slots(self, starts, lens, tables):
        """Vectorised: positions of every new token and the cache slot it writes."""
        lens_t = torch.tensor(lens, dtype=torch.long)
        req_index = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
        first_row = torch.cumsum(lens_t, 0) - lens_t
        offsets = torch.arange(int(lens_t.sum())) - first_row[req_index]
        positions = torch.tensor(starts, dtype=torch.long)[req_index] + offsets
        slots = self._slots(tables[req_index], positions.unsqueeze(1)).squeeze(1)
        dev = self.device
        return positions.to(dev, non_blocking=True), slots.to(dev, non_blocking=True)

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tables: [..., max_blocks]; positions: same leading dims, any last dim."""
        bs = self.block_size
        blocks = tables.gather(-1, (positions // bs).clamp(max=tables.shape[-1] - 1))
        return blocks * bs + positions % bs

    def _attention_spans(self, meta, scheduled, tables, query_starts) -> None:
        decode_idx = []
        for i, s in enumerate(scheduled):
            if s.num_new_tokens == 1:
                decode_idx.append(i)
                continue
            meta.prefills.append(self._prefill_span(s, tables[i], query_starts[i]))
        if decode_idx:
            meta.decodes = self._decode_batch(scheduled, tables, query_starts, decode_idx)

    def _prefill_span(self, s: ScheduledRequest, table: torch.Tensor, q_start: int):
        context_len = s.start + s.num_new_tokens
        slots = self._slots(table, torch.arange(context_len))
        mask = None
        if s.start > 0:  # a prefix is already cached: causal with an offset
            q_pos = torch.arange(s.start, context_len).unsqueeze(1)
            mask = (torch.arange(context_len).unsqueeze(0) <= q_pos).to(self.device)
        return PrefillSpan(q_start, s.num_new_tokens, slots.to(self.device), mask)

    def _decode_batch(self, scheduled, tables, query_starts, idx) -> DecodeBatch:
        ctx = torch.tensor([scheduled[i].start + 1 for i in idx], dtype=torch.long)
        max_ctx = int(ctx.max())
        key_pos = torch.arange(max_ctx).unsqueeze(0).expand(len(idx), max_ctx)
        slots = self._slots(tables[idx], key_pos)
        mask = (key_pos < ctx.unsqueeze(1))
        dev = self.device
        return DecodeBatch(
            rows=torch.tensor([query_starts[i] for i in idx], dtype=torch.long).to(dev),
            context_slots=slots.to(dev), mask=mask[:, None, None, :].to(dev))


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
