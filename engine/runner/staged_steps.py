"""Pipeline stages (engine/ranks/pipeline.py), a part of the ModelRunner
(model_runner.py) whose process is the last stage: a step goes to the first stage
when it is launched, and this stage's layers, the LM head and sampling run when it
comes back (finish), each step's copy-on-write copies made just before its layers,
in launch order, as every stage makes them. Uses the runner's model, pipeline,
attention backend, sampler, pooler and KV caches."""
from __future__ import annotations

from kvserve.engine.kernels.attention import clear_attention_context, set_attention_context
from kvserve.engine.models.kv_caches import copy_blocks
from kvserve.engine.runner.step_batch import LaunchedStep
from kvserve.engine.sampling.step_logits import StepLogits
from kvserve.scheduler.output import ScheduledRequest


class StagedSteps:
    def _launch_staged(self, scheduled: list[ScheduledRequest]) -> LaunchedStep:
        """Pipeline stages: the step into the first stage, nothing waited for."""
        batch, failed = self._prepare_isolated(scheduled, None)
        step = LaunchedStep(failed=failed)
        if batch is not None:
            self.pipeline.send(batch.host, batch.input_ids, batch.logit_rows)
            step.staged, self._staged_copies = (batch, self._staged_copies), []
        return step

    def _finish_staged(self, step: LaunchedStep) -> None:
        """The step back from the stage before: this stage's layers (after the copies
        made when it was launched, as every stage does), the LM head, sampling."""
        batch, copies = step.staged
        hidden = self.pipeline.receive(len(batch.input_ids))
        copy_blocks(self.all_kv_caches, copies)
        # The attention metadata prepared at launch: each step's own tensors, which
        # no later step's preparation touches (as async scheduling relies on too).
        set_attention_context(self.attn_backend, batch.attention)
        try:
            hidden = self.model.forward_stage(hidden, batch.positions)
        finally:
            clear_attention_context()
        if batch.pooling:
            step.pooled = self.pooler.observe(hidden, batch.pooling)
        # Every step, as the stage's other tensor-parallel ranks (they gather here).
        logits = self.model.compute_logits(hidden[batch.logit_rows])
        if batch.sampling or batch.prompt_spans:
            step.sample = self.sampler.launch(StepLogits.of(logits, batch.rows),
                                              batch.sampling, batch.prompt_spans)

    def _release_ended(self, step: LaunchedStep) -> None:
        """A request that ended (aborted) while its step was in flight was released
        before that step sampled for it: released again."""
        for s in step.staged[0].sampling:
            if s.request.finished:
                self.sampler.release(s.request.request_id)

    def _queue_copies(self, triples: list[tuple[int, int, int]]) -> None:
        self.pipeline.pending_copies += triples  # sent with the next step
        self._staged_copies += triples  # made here when that step comes back
