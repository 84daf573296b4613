"""A pipeline stage's part of a model (--pipeline-parallel-size): a run of
consecutive layers, plus the embedding on the first stage and the final norm and LM
head on the last. The model is built whole on the meta device and then pruned here
before it gets storage, so a stage allocates, loads and caches only its own part;
the layers it does not hold keep their places (and the checkpoint's layer numbers)
as parameterless placeholders."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    index: int
    size: int
    start: int  # its first layer
    end: int  # past its last layer

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def whole(self) -> bool:
        return self.size == 1


def split_layers(num_layers: int, size: int, head: float = 0.0) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers, so that no stage has much more work
    than another: the last stage also runs the LM head, `head` layers' worth of it,
    and takes that many fewer (at least one); the others share the rest evenly, the
    earlier ones taking the remainder. (vLLM splits evenly; its stages then wait on
    the last, whose head is, at a decode, a quarter of a small model's work.)"""
    if size > num_layers:
        raise ValueError(f"--pipeline-parallel-size {size} is more than the model's "
                         f"{num_layers} layers")
    last = num_layers if size == 1 else max(1, min(
        num_layers - (size - 1), round((num_layers + head) / size - head)))
    base, extra = divmod(num_layers - last, max(1, size - 1))
    bounds, start = [], 0
    for i in range(size - 1):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds + [(start, num_layers)]


def head_in_layers(cfg) -> float:
    """The LM head's multiply-adds a token over one layer's (dense, or the experts a
    token goes through): what a decode step's head costs in layers."""
    h = cfg.hidden_size
    attention = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    moe = cfg.moe
    if moe is not None:
        mlp = 3 * h * (moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size)
    else:
        mlp = 3 * h * cfg.intermediate_size
    return cfg.vocab_size * h / (attention + mlp)


def stage_of(cfg, index: int, size: int) -> PipelineStage:
    """Stage `index` of `size` of the model whose ModelConfig is cfg."""
    start, end = split_layers(cfg.num_layers, size, head_in_layers(cfg))[index]
    return PipelineStage(index, size, start, end)


WHOLE = PipelineStage(0, 1, 0, 1 << 30)


class AbsentPart(nn.Module):
    """A part of the model another stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model is another pipeline stage's")


def prune_to_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Replaces what `stage` does not hold by AbsentPart (on the meta device, before
    the model gets storage). A tied LM head keeps the embedding on the last stage:
    it is the head's weight. Records the pruned names' prefixes for the loader."""
    absent: list[str] = []
    for i in range(len(model.layers)):
        if not stage.start <= i < stage.end:
            model.layers[i] = AbsentPart()
            absent.append(f"layers.{i}.")
    tied = model.config.tie_word_embeddings
    if not stage.first and not (tied and stage.last):
        model.embed_tokens = AbsentPart()
        absent.append("embed_tokens.")
    if not stage.last:
        model.norm, model.lm_head = AbsentPart(), AbsentPart()
        absent += ["norm.", "lm_head."]
    model.stage = stage
    model.absent_prefixes = tuple(absent)


def held_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, layer) of every layer this process holds."""
    return [(i, layer) for i, layer in enumerate(model.layers)
            if not isinstance(layer, AbsentPart)]
