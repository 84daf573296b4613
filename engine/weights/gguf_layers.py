"""A GGUF's quantized tensors as our layers (gguf_blocks.py's integers and scales,
never expanded): a projection's shards as one int4 or group-int8 layer, or one a
shard where their types differ; the embedding table and the LM head where kept."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvserve.engine.models.quantized.int4 import PACK_ROWS, Int4Linear
from kvserve.engine.models.quantized.int8 import GroupInt8Linear
from kvserve.engine.models.quantized.stacked import StackedLinear
from kvserve.engine.models.quantized.table import QuantizedEmbedding, QuantizedTable
from kvserve.engine.platform.gguf_blocks import GroupQuant, concat_rows
from kvserve.engine.platform.gguf_checkpoint import KEPT_QUANTIZED, GGUFCheckpoint
from kvserve.modelstore.errors import ModelLoadError


def repack(ckpt: GGUFCheckpoint, layer: nn.Module, proj: str, sources: list[str],
           biases: list[str], dtype: torch.dtype, device: torch.device) -> str | None:
    """Replace `proj` with quantized layers holding the file's integers and scales
    when all of its tensors are of kept types (lossless either way): one layer where
    the shards share a type, else one per shard (StackedLinear); None leaves it to
    be expanded. Returns the kind of layer made."""
    if not sources or any(ckpt.type_name(s) not in KEPT_QUANTIZED for s in sources):
        return None
    parent_name, _, attr = proj.rpartition(".")
    parent = layer.get_submodule(parent_name)
    expected = tuple(getattr(parent, attr).weight.shape)
    parts = [ckpt.group_quant(s) for s in sources]
    found = (sum(p.q.shape[0] for p in parts), parts[0].q.shape[1])
    if found != expected or any(p.q.shape[1] != found[1] for p in parts):
        raise ModelLoadError(f"{proj} from {sources} has shape {found}, expected {expected}")
    bias = [ckpt.float_tensor(b).to(device) for b in biases] or [None] * len(parts)
    if len({ckpt.type_name(s) for s in sources}) > 1:
        shards = [quantized_layer(p, dtype, device, b) for p, b in zip(parts, bias)]
        setattr(parent, attr, StackedLinear([m for m, _ in shards]))
        return "+".join(sorted({kind for _, kind in shards}))
    new, kind = quantized_layer(concat_rows(parts), dtype, device,
                                torch.cat(bias) if biases else None)
    setattr(parent, attr, new)
    return kind


def quantized_layer(blocks: GroupQuant, dtype: torch.dtype, device: torch.device,
                    bias: torch.Tensor | None = None) -> tuple[nn.Module, str]:
    """int4 where the codes are 16 and the rows fill the CPU kernel's blocks, else
    a byte a weight."""
    def tensor(values: np.ndarray | None) -> torch.Tensor | None:  # [N, g] -> [g, N]
        return None if values is None else torch.from_numpy(
            np.ascontiguousarray(values.T)).to(device)

    if blocks.fits_int4() and blocks.q.shape[0] % PACK_ROWS == 0:
        blocks = blocks.shifted()
        codebook = None if blocks.codebook is None else torch.from_numpy(blocks.codebook)
        return Int4Linear(torch.from_numpy(blocks.q.astype(np.uint8)), tensor(blocks.scales),
                          tensor(blocks.mins), bias, dtype,
                          scale_base=tensor(blocks.scale_base),
                          min_base=tensor(blocks.min_base),
                          codebook=None if codebook is None else codebook.to(device)), "int4"
    q = blocks.q if blocks.codebook is None else blocks.codebook[blocks.q]  # int8 values
    return GroupInt8Linear(torch.from_numpy(q.astype(np.int8)).to(device),
                           tensor(blocks.scales), bias, dtype, tensor(blocks.mins),
                           scale_base=tensor(blocks.scale_base),
                           min_base=tensor(blocks.min_base)), "int8"


def keep_vocabulary(ckpt: GGUFCheckpoint, model: nn.Module, names: dict,
                    tied: bool, dtype: torch.dtype, device: torch.device,
                    panels_here: bool = False) -> list[str]:
    """The LM head (the embedding table where tied) kept in its file's blocks where
    its quantized layer has a kernel here: torch's int4 one (bf16 on CPU), or
    kvserve's CPU GEMM where it will pack the quantized layers (panels_here) and the
    blocks fit its panels (Q8_0). A head expanded every step costs more than its
    bytes save (the default model's Q8_0 table expanded a step: 9 against 48
    tokens/s), so elsewhere it is read as floats. Kept, the default model's Q8_0
    head is 29 MiB a step read in place of 54 in bf16, its largest read. The
    embedding table kept in its blocks too (a lookup expands only its rows), unless
    it is the float head's own weight (one copy). What is kept leaves `names` (the
    tensors read as floats); returns the kinds kept."""
    kinds = []
    embd = "token_embd.weight"
    source = embd if tied else "output.weight"
    head_kept = False
    if ckpt.type_name(source) in KEPT_QUANTIZED:
        head, kind = quantized_layer(ckpt.group_quant(source), dtype, device)
        if getattr(head, "kernel_scales_zeros", None) is not None or (
                panels_here and head.fits_panels()):
            model.lm_head = head
            kinds.append(f"head {kind}")
            names.pop("output.weight", None)
            head_kept = True
    if ckpt.type_name(embd) in KEPT_QUANTIZED and (head_kept or not tied):
        table = QuantizedTable(ckpt.group_quant(embd), dtype, device)
        model.embed_tokens = QuantizedEmbedding(table)
        kinds.append("table int4" if table.nibbles else "table int8")
        names.pop(embd)
    return kinds
