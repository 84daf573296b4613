"""Executes one scheduled step: copy-on-write block copies, a flat batch, the model's
forward pass over it, and sampling (with logprobs and prompt logprobs on request)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path

import torch

from kvserve.engine.kernels.attention import (clear_attention_context, prepare_step,
                                              set_attention_context)
from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.step_metadata import HostStep, build_host_step
from kvserve.engine.lora.manager import LoRAManager
from kvserve.engine.models.kv_caches import (KVCacheFormat, LayerGroups, attach_kv_caches,
                                             copy_blocks)
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.platform import faults
from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.ranks.pipeline import PipelineGroup
from kvserve.engine.ranks.step_channel import StepChannel
from kvserve.engine.runner.block_table_rows import BlockTableRows
from kvserve.engine.runner.compiled_model import CompiledModel
from kvserve.engine.runner.cuda_graphs import DecodeGraphPlan
from kvserve.engine.runner.forward_paths import ForwardPaths, traced_decode
from kvserve.engine.runner.pooling import Pooler, pool_rows
from kvserve.engine.runner.staged_steps import StagedSteps
from kvserve.engine.runner.step_batch import FlatBatch, LaunchedStep
from kvserve.engine.sampling import Sampler, StepResult
from kvserve.engine.sampling.logprobs import MAX_EXACT_ID
from kvserve.engine.sampling.step_logits import LogitRows, StepLogits
from kvserve.engine.structured.matchers import Matchers
from kvserve.scheduler.output import ScheduledRequest, SchedulerOutput

log = logging.getLogger("kvserve.engine")


class ModelRunner(StagedSteps):
    """Everything a step uses is handed over here: the attention backend, the drafter
    that fills model-drafted placeholders before a step (speculative early exit or a
    draft model; None without), the plan for decode-only steps' CUDA graphs, and the
    LoRA adapters (engine/lora/manager.py; None: LoRA off), and under tensor
    parallelism the channel that hands each step to the other ranks (rank 0's
    runner is the only one: the others run the steps it sends). Which forward pass a
    step takes is engine/runner/forward_paths.py's to decide."""

    def __init__(self, model: DecoderModel, *, num_blocks: int, block_size: int,
                 device: torch.device, kv_format: KVCacheFormat,
                 attn_backend: AttentionBackend,
                 drafter=None, decode_graphs: DecodeGraphPlan | None = None,
                 lora: LoRAManager | None = None, step_channel: StepChannel | None = None,
                 matchers: Matchers | None = None, layer_groups: LayerGroups | None = None,
                 pipeline: PipelineGroup | None = None):
        self.model, self.device, self.block_size = model, device, block_size
        self.drafter, self.lora = drafter, lora
        groups = layer_groups.window_groups if layer_groups is not None else 0
        self.paths = ForwardPaths(model, attn_backend, device, block_size, lora, groups)
        self.step_channel = step_channel
        self.pipeline = pipeline  # the stages before this one (staged_steps.py)
        self._staged_copies: list[tuple[int, int, int]] = []
        self.kv_tier = None  # engine/kv_offload/'s, set by its build: copies it queued
        cfg = model.config
        # One block more than the KV cache manager hands out: the compiled graphs'
        # warm-up steps write there (background compiling runs beside live steps).
        self.spare_block = num_blocks
        self.kv_caches = attach_kv_caches(model, num_blocks + 1, block_size, kv_format, device,
                                          layer_groups)
        if cfg.vocab_size >= MAX_EXACT_ID:
            raise ValueError("vocabularies of 2**24 tokens or more are not supported")
        self.sampler = Sampler(device, matchers)  # matchers: structured outputs' masks
        self.pooler = Pooler()  # embedding requests' partial sums
        # The running requests' block tables: the full-attention layers', then a
        # hybrid model's sliding layer groups' (kvcache/hybrid.py).
        self.table_rows = BlockTableRows()
        self.group_rows = [BlockTableRows(group=g) for g in range(1, groups + 1)]
        if decode_graphs is not None:
            self.paths.use_decode_graphs(decode_graphs)

    # The forward paths' state, as everyone holding a runner reads it.
    attn_backend = property(lambda self: self.paths.backend)
    decode_graphs = property(lambda self: self.paths.decode_graphs)
    compiling = property(lambda self: self.paths.compiling)
    compiled = property(lambda self: self.paths.compiled)

    @property
    def warming_up(self) -> bool:
        """Steps run eagerly while the compiled forward pass is being built (several
        times slower on CPU); False once it is built or has failed, or without one."""
        building = self.paths.compiling
        return building is not None and not building.ready.is_set()

    def use_decode_graphs(self, plan: DecodeGraphPlan) -> None:
        self.paths.use_decode_graphs(plan)

    def compile_forward(self, background: bool, packages: Path | None = None,
                        build_packages: Callable[[], None] | None = None) -> CompiledModel:
        """packages: the graphs as AOTInductor packages kept in this folder, where
        they apply (engine/runner/graph_packages.py); build_packages builds those
        missing elsewhere (engine/core/package_build_process.py; None: here)."""
        return self.paths.compile(background, self._warm_up_step, packages, build_packages)

    @torch.inference_mode()
    def _warm_up_step(self, backend: AttentionBackend, fn, num_tokens: int,
                      decode: bool, lora: bool = False) -> None:
        """Runs a compiled function over steps that read and write only the spare
        block. decode: num_tokens one-token requests with two blocks of context each
        (no dimension of size 1 may be specialised on), as fn(ids, positions, paged).
        Else fn(ids, positions) twice, over one prompt of num_tokens beside one
        decode, then two: the decodes of mixed steps have graphs of their own, for
        one request and for more (cpu_paged.paged_decode). lora: every token
        through adapter slot 0, for the graphs that take adapters."""
        spare, bs = self.spare_block, self.block_size
        limit = self.model.rotary.max_positions
        start = min(2 * bs, limit) - 1
        if decode:
            steps = [([start] * num_tokens, [1] * num_tokens, [[spare, spare]] * num_tokens)]
        else:
            prompt = min(num_tokens, limit)
            # Every table two blocks wide, the prompt's too: a narrower row would be
            # padded with block 0, which a live request may own.
            steps = [([start] * d + [0], [1] * d + [prompt], [[spare, spare]] * (d + 1))
                     for d in (1, 2)]
        for starts, lens, tables in steps:
            host = build_host_step(starts, lens, tables, bs, [tables] * len(self.group_rows))
            ids = torch.zeros(len(host.positions), dtype=torch.long)
            positions, common, (input_ids,) = host.to_device(self.device, [ids])
            meta = prepare_step(backend, common)
            set_attention_context(backend, meta)
            adapters = (self.lora.warm_up_inputs(len(ids), per_token=decode),) if lora else ()
            try:
                if decode:
                    fn(input_ids, positions, traced_decode(backend, meta), *adapters)
                else:
                    fn(input_ids, positions, *adapters)
            finally:
                clear_attention_context()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None
               ) -> LaunchedStep:
        """Sends the step to the device without waiting for it. `previous`: the step
        still running whose sampled tokens are this step's pending ones (async
        scheduling); they go from its output to this step's input on the device."""
        if self.kv_tier is not None:  # blocks out to and back from the second tier
            self.kv_tier.apply()
        self.copy_blocks(out.block_copies)
        for request_id in out.preempted:  # readmitted, it gets other blocks
            self._drop_rows(request_id)
        if self.pipeline is not None:
            return self._launch_staged(out.scheduled)
        if self.paths.takes_decode_graphs(out.scheduled, self.drafter):
            return self._launch_decode(out.scheduled, previous)
        if self.drafter is not None:
            self._draft(out.scheduled)
        batch, failed = self._prepare_isolated(out.scheduled, previous)
        step = LaunchedStep(failed=failed)
        if batch is not None:
            logits = self.forward_logits(batch)
            step.pooled = batch.pooled
            if self.drafter is not None:
                self.drafter.observe(batch)  # a draft model's own cache keeps up
            if batch.sampling or batch.prompt_spans:
                step.sample = self.sampler.launch(StepLogits.of(logits, batch.rows),
                                                  batch.sampling, batch.prompt_spans,
                                                  previous and previous.sample)
            if batch.verifying:
                step.verified = StepResult()
                self.sampler.verify(StepLogits.verify_rows(logits, batch.rows),
                                    batch.verifying, step.verified)
        return step

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> StepResult:
        """Waits for a launched step and returns what it sampled."""
        if step.staged is not None:
            self._finish_staged(step)
        result = self.sampler.finish(step.sample) if step.sample is not None else StepResult()
        if step.staged is not None:
            self._release_ended(step)
        if step.verified is not None:
            result.tokens.update(step.verified.tokens)
            result.failed.update(step.verified.failed)
        result.failed.update(step.failed)
        result.embeddings = {rid: v.tolist() for rid, v in step.pooled.items()}
        return result

    def _draft(self, scheduled: list[ScheduledRequest]) -> None:
        items = [s for s in scheduled if s.spec_token_ids and s.spec_token_ids[0] < 0]
        if items:
            self.drafter.fill(items)

    def _prepare_isolated(self, scheduled: list[ScheduledRequest],
                          previous: LaunchedStep | None
                          ) -> tuple[FlatBatch | None, dict[str, str]]:
        """prepare(); if it raises, the requests it raises for alone are left out of
        the step and reported as failed (None: nobody is left)."""
        try:
            return self.prepare(scheduled, previous), {}
        except Exception as exc:  # noqa: BLE001 - blamed on requests, or re-raised
            by_id = {s.request.request_id: s for s in scheduled}
            failed = faults.blame(exc, by_id,
                                  lambda rid: self.prepare([by_id[rid]], previous),
                                  "batch preparation")
            keep = [s for s in scheduled if s.request.request_id not in failed]
            return (self.prepare(keep, previous) if keep else None), failed

    @torch.inference_mode()
    def profile_step(self, num_tokens: int, num_sampling_rows: int) -> None:
        """The largest step the engine will run, for its peak memory: one prompt of
        num_tokens through blocks 0.., and logits plus sampling probabilities for
        num_sampling_rows rows (the last hidden row repeated)."""
        blocks = list(range(-(-num_tokens // self.block_size)))
        host = build_host_step([0], [num_tokens], [blocks], self.block_size,
                               [[blocks]] * len(self.group_rows))
        ids = torch.zeros(num_tokens, dtype=torch.long)
        positions, common, (input_ids,) = host.to_device(self.device, [ids])
        set_attention_context(self.attn_backend, prepare_step(self.attn_backend, common))
        try:
            hidden = self.model(input_ids, positions)
        finally:
            clear_attention_context()
        logits = self.model.compute_logits(hidden[-1:].expand(num_sampling_rows, -1))
        logits.softmax(dim=-1).sort(dim=-1)  # top-p sorts the probabilities

    def _launch_decode(self, scheduled: list[ScheduledRequest],
                       previous: LaunchedStep | None) -> LaunchedStep:
        """A decode-only step through the padded (captured) forward pass."""
        host = self._host_step(scheduled, [1] * len(scheduled))
        ids = to_device([0 if s.num_pending else s.request.token_ids[s.start]
                         for s in scheduled], torch.long, self.device)
        self._feed_pending(ids, scheduled, list(range(len(scheduled))), previous)
        lora = (self.lora.token_slots([s.request.lora for s in scheduled], [1] * len(ids))
                if self.lora is not None else None)
        logits = self.decode_graphs.run(host, ids, lora)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        if len(rows) != len(scheduled):  # a one-token prompt chunk samples nothing
            logits = logits[to_device(rows, torch.long, logits.device)]
        sampling = [scheduled[i] for i in rows]
        return LaunchedStep(self.sampler.launch(StepLogits(logits, len(sampling)), sampling, [],
                                                previous and previous.sample)
                            if sampling else None)

    def _feed_pending(self, input_ids: torch.Tensor, scheduled: list[ScheduledRequest],
                      last_rows: list[int], previous: LaunchedStep | None) -> None:
        """Writes each pending token (the last input row of a request whose token the
        previous step is still sampling) from that step's output, on the device."""
        pending = [(s, row) for s, row in zip(scheduled, last_rows) if s.num_pending]
        if not pending:
            return
        if previous is None or any(s.num_pending > 1 for s, _ in pending):
            raise RuntimeError("pending tokens need the one step still running")
        device = input_ids.device
        tokens, index = previous.feed_source(device)
        # A request missing there failed in that step (it samples nothing there, so
        # it is failed before this step's results are read): its row keeps a 0.
        pairs = [(row, index[s.request.request_id]) for s, row in pending
                 if s.request.request_id in index]
        if pairs:
            dst, src = zip(*pairs)
            input_ids[to_device(dst, torch.long, device)] = tokens[to_device(src, torch.long,
                                                                             device)]

    def forward_logits(self, batch: FlatBatch) -> torch.Tensor:
        if self.step_channel is not None:  # every rank runs this forward pass
            self.step_channel.send(batch.host, batch.input_ids, batch.logit_rows)
        set_attention_context(self.attn_backend, batch.attention)
        try:
            hidden, are_logits = self.paths.run(batch)
        finally:
            clear_attention_context()
        if are_logits:
            return hidden
        if batch.pooling:
            batch.pooled = self.pooler.observe(hidden, batch.pooling)
        return self.model.compute_logits(hidden[batch.logit_rows])

    @property
    def all_kv_caches(self) -> list[tuple]:
        """Every (k, v) pair a block id indexes: the model's and its drafter's."""
        return self.kv_caches + getattr(self.drafter, "kv_caches", [])

    def copy_blocks(self, copies) -> None:
        if not copies:  # almost every step: build nothing
            return
        triples = [(c.src, c.dst, c.num_tokens) for c in copies]
        if self.step_channel is not None:  # the other ranks copy with the next step
            self.step_channel.pending_copies += triples
        if self.pipeline is not None:  # every stage copies before its next step's layers
            return self._queue_copies(triples)
        copy_blocks(self.all_kv_caches, triples)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        self.pooler.release(request_id)
        self._drop_rows(request_id)

    def _drop_rows(self, request_id: str) -> None:
        for rows in (self.table_rows, *self.group_rows):
            rows.drop(request_id)

    def _host_step(self, scheduled: list[ScheduledRequest], lens: list[int]) -> HostStep:
        """The step's host metadata over every layer group's block tables."""
        return build_host_step([s.start for s in scheduled], lens,
                               self.table_rows.gather(scheduled), self.block_size,
                               [rows.gather(scheduled) for rows in self.group_rows])

    # -- batch preparation -----------------------------------------------------
    @faults.fault_point("prepare", lambda self, scheduled, *_: [s.request for s in scheduled])
    def prepare(self, scheduled: list[ScheduledRequest],
                previous: LaunchedStep | None = None) -> FlatBatch:
        # Decodes first (a stable sort): backends find them in rows 0..B-1. A request
        # verifying drafts queries k + 1 rows, like a short prompt chunk.
        scheduled = sorted(scheduled, key=lambda s: s.num_new_tokens + len(s.spec_token_ids) > 1)
        lens = [s.num_new_tokens + len(s.spec_token_ids) for s in scheduled]
        query_starts = [0, *accumulate(lens)]
        ids: list[int] = []
        for s in scheduled:
            ids.extend(s.request.token_ids[s.start:s.start + s.num_new_tokens - s.num_pending])
            ids.extend([0] * s.num_pending)  # fed on the device (_feed_pending)
            ids.extend(s.spec_token_ids)
        sampling = [s for s in scheduled if s.samples and not s.spec_token_ids]
        rows = [query_starts[i + 1] - 1 for i, s in enumerate(scheduled)
                if s.samples and not s.spec_token_ids]
        spans = self.sampler.prompt.plan(scheduled, query_starts)
        for span in spans:
            rows.extend(range(span.row, span.row + span.count))
        num_prompt = len(rows) - len(sampling)
        verifying = [s for s in scheduled if s.spec_token_ids]
        for i, s in enumerate(scheduled):
            if s.spec_token_ids:
                rows.extend(range(query_starts[i], query_starts[i + 1]))
        counts = LogitRows(len(sampling), num_prompt, len(rows) - len(sampling) - num_prompt)
        host = self._host_step(scheduled, lens)
        positions, common, (input_ids, logit_rows) = host.to_device(
            self.device, [torch.tensor(ids, dtype=torch.long),
                          torch.tensor(rows, dtype=torch.long)])
        self._feed_pending(input_ids, scheduled,
                           [query_starts[i] + s.num_new_tokens - 1
                            for i, s in enumerate(scheduled)], previous)
        lora = (self.lora.step_inputs([s.request.lora for s in scheduled], lens)
                if self.lora is not None else None)
        return FlatBatch(input_ids=input_ids, positions=positions,
                         attention=prepare_step(self.attn_backend, common),
                         logit_rows=logit_rows,
                         rows=counts, sampling=sampling, prompt_spans=spans,
                         verifying=verifying, pooling=pool_rows(scheduled, query_starts),
                         lora=lora, host=host)
