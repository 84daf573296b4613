"""CUDA graphs for decode-only steps.

A decode step at small batch is launch-bound: hundreds of small kernels whose launch
costs more than their work. A CUDA graph replays the whole forward pass with one
launch, but only over fixed shapes and fixed buffers. So the step is padded up to
the smallest captured batch size ("bucket": 1, 2, 4, 8, then multiples of 16 up to
--max-num-seqs) and its inputs are copied into static buffers the graph was captured
on. Padded rows write nowhere (slot -1) and their logits are ignored.

With LoRA on, each bucket has a second graph whose steps add the adapters' product
(engine/models/lora_step.py) for each row's slot, read from a static buffer (-1 on padded
rows and base-model rows): a step with no adapter request replays the graph without
LoRA and pays nothing for it.

The padded static-shape path also runs without capture (`capture=False`): that is
how it is tested on CPU, and how --enforce-eager could keep the padding. Mixed steps
(any prompt chunk) run eagerly in the model runner."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.engine.kernels.attention import (clear_attention_context, prepare_step,
                                              set_attention_context)
from kvserve.engine.kernels.attention.context import AttentionMetadata
from kvserve.engine.kernels.attention.step_metadata import HostStep, upload


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class _Static:
    """Device buffers at the largest bucket; a bucket uses their first rows."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    lora_slots: torch.Tensor  # each row's adapter slot (-1: none)
    # A hybrid model's sliding layer groups' (slot_mapping, block_tables), group 1 first
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, device: torch.device,
                 window_groups: int = 0) -> "_Static":
        def z(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        def slots():
            return torch.full((rows,), -1, dtype=torch.long, device=device)
        return cls(z(rows, dtype=torch.long), z(rows, dtype=torch.long), slots(),
                   torch.ones(rows, dtype=torch.int32, device=device),
                   z(rows, max_blocks, dtype=torch.int32),
                   torch.arange(rows + 1, dtype=torch.int32, device=device),
                   torch.full((rows,), -1, dtype=torch.int32, device=device),
                   tuple((slots(), z(rows, max_blocks, dtype=torch.int32))
                         for _ in range(window_groups)))


@dataclass(frozen=True)
class DecodeGraphPlan:
    """Decode-only steps through padded static buffers, one per batch-size bucket up
    to max_num_seqs; captured as CUDA graphs when `capture` (CUDA and a graph-safe
    attention backend only), else run eagerly (the same padding, for tests)."""
    max_num_seqs: int
    max_model_len: int
    capture: bool = True


class DecodeGraphs:
    def __init__(self, model, backend, block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device, capture: bool, lora=None,
                 window_groups: int = 0):
        """lora: the engine's LoRAManager (None: LoRA off); window_groups: a hybrid
        model's sliding layer groups (kvcache/hybrid.py), each with its own tables."""
        self.model, self.backend, self.block_size = model, backend, block_size
        self.lora = lora
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len, self.device, self.capture = max_model_len, device, capture
        max_blocks = -(-max_model_len // block_size)
        self.static = _Static.allocate(self.buckets[-1], max_blocks, device, window_groups)
        # (bucket, with LoRA) -> its graph and the logits it writes
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.buckets[-1]

    def bucket(self, num_reqs: int) -> int:
        return next(b for b in self.buckets if b >= num_reqs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every bucket, largest first so the smaller ones reuse its memory
        pool. Each runs once eagerly first: kernels compile (Triton JIT) outside the
        capture, and lazy allocations happen before it."""
        pool = None
        for key in [(b, lora) for b in reversed(self.buckets)
                    for lora in (False, True)[:1 + (self.lora is not None)]]:
            self._forward(*key)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[key] = self._forward(*key)
            pool = graph.pool()
            self.graphs[key] = graph

    def run(self, host: HostStep, input_ids: torch.Tensor,
            lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B requests (B <= the largest
        bucket); host: its metadata from build_host_step; lora_slots: each request's
        adapter slot (None: no request has an adapter)."""
        n = len(host.seq_lens)
        key = (self.bucket(n), lora_slots is not None)
        self._load(host, input_ids, n, key[0], lora_slots)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.logits[key][:n]
        return self._forward(*key, host_seq_lens=host.seq_lens)[:n]

    def _load(self, host: HostStep, input_ids: torch.Tensor, n: int, b: int,
              lora_slots: torch.Tensor | None) -> None:
        """The step's inputs into the static rows. The host values go up first through
        pinned memory, one transfer per dtype (upload): a copy straight from pageable
        memory into a static buffer would wait for the stream to drain, i.e. for the
        step launched before, and undo async scheduling. The rest are copies on the
        device. input_ids and lora_slots are on the device already."""
        s, nb = self.static, host.block_tables.shape[1]
        positions, slots, seq_lens, tables, *groups = upload(
            [host.positions, host.slot_mapping, host.seq_lens, host.block_tables,
             *(t for group in host.groups for t in group)], self.device)
        if lora_slots is not None:  # padded rows keep -1
            s.lora_slots[:n].copy_(lora_slots, non_blocking=True)
        s.input_ids[:n].copy_(input_ids, non_blocking=True)
        s.positions[:n].copy_(positions, non_blocking=True)
        s.slot_mapping[:n].copy_(slots, non_blocking=True)
        s.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        s.block_tables[:n, :nb].copy_(tables, non_blocking=True)
        for (group_slots, group_tables), new_slots, new_tables in zip(
                s.groups, groups[::2], groups[1::2]):
            group_slots[:n].copy_(new_slots, non_blocking=True)
            group_tables[:n, :nb].copy_(new_tables, non_blocking=True)
        if b > n:  # padding rows: a 1-token context, written nowhere
            s.lora_slots[n:b].fill_(-1)
            s.seq_lens[n:b].fill_(1)
            s.positions[n:b].zero_()
            for slot_mapping, block_tables in ((s.slot_mapping, s.block_tables), *s.groups):
                slot_mapping[n:b].fill_(-1)
                block_tables[n:b, 0].zero_()

    def _forward(self, b: int, lora: bool = False,
                 host_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """The captured body: the model over the first b static rows (lora: adding
        each row's adapter)."""
        s, seq_lens_cpu = self.static, host_seq_lens
        if seq_lens_cpu is not None and len(seq_lens_cpu) < b:  # eager: pads count too
            pad = torch.ones(b - len(seq_lens_cpu), dtype=seq_lens_cpu.dtype)
            seq_lens_cpu = torch.cat([seq_lens_cpu, pad])
        meta = AttentionMetadata(
            slot_mapping=s.slot_mapping[:b], query_start_loc=s.query_start_loc[:b + 1],
            seq_lens=s.seq_lens[:b], block_tables=s.block_tables[:b],
            query_start_loc_cpu=torch.arange(b + 1, dtype=torch.int32),
            # Captured: no host copy of the lengths; backends then plan for the
            # longest context the model allows (the graph must hold for any).
            seq_lens_cpu=seq_lens_cpu, max_query_len=1,
            max_seq_len=self.max_model_len, num_decodes=b, num_prefills=0,
            num_tokens=b, block_size=self.block_size)
        meta.groups = tuple(replace(meta, slot_mapping=slots[:b], block_tables=tables[:b])
                            for slots, tables in s.groups)
        set_attention_context(self.backend, prepare_step(self.backend, meta))
        try:
            adapters = self.lora.inputs(s.lora_slots[:b]) if lora else None
            hidden = self.model(s.input_ids[:b], s.positions[:b], lora=adapters)
        finally:
            clear_attention_context()
        return self.model.compute_logits(hidden)
