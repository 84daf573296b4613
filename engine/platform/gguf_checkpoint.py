"""A GGUF file's tensors, read through the `gguf` package (llama.cpp's own reader),
as our layers want them: quantized blocks split into their integer values and group
scales without rounding anything (gguf_blocks.py), or de-quantized to float32 by
gguf itself.

llama.cpp's converter permutes the rows of Llama's query and key projections (its
RoPE pairs neighbouring dimensions, Hugging Face's pairs the two halves); rows are
whole blocks, so undoing it moves bytes and changes no value. Qwen2/Qwen3 files are
not permuted (llama.cpp rotates them the Hugging Face way)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvserve.engine.platform.gguf_blocks import DECODERS, GroupQuant, decode
from kvserve.modelstore.errors import ModelLoadError

# Types whose blocks are repacked as they are, never expanded to floats.
KEPT_QUANTIZED = tuple(DECODERS)
FLOAT_TYPES = ("F32", "F16", "BF16")
# The GGUF architectures read (their configs: gguf_config.py).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3",
                 "phi3", "gpt-oss", "deepseek2")


def find_gguf(model_dir: Path) -> Path:
    """`model_dir` is a .gguf file, or a directory holding exactly one."""
    if model_dir.is_file() and model_dir.suffix == ".gguf":
        return model_dir
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) != 1:
        raise ModelLoadError(f"--load-format gguf needs exactly one *.gguf file in "
                             f"{model_dir}, found {len(files)}")
    return files[0]


class GGUFCheckpoint:
    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"{path.name}: GGUF architecture {self.architecture!r} "
                                 f"is not supported; kvserve reads {', '.join(ARCHITECTURES)} "
                                 "GGUF files (or serve the model's safetensors directory)")
        self.num_heads = int(self.field(self.key("attention.head_count")))
        self.num_kv_heads = int(self.field(self.key("attention.head_count_kv")))

    def key(self, name: str) -> str:
        """A metadata key of the file's architecture (llama.embedding_length, ...)."""
        return f"{self.architecture}.{name}"

    def field(self, key: str):
        field = self.reader.fields.get(key)
        if field is None:
            raise ModelLoadError(f"{self.path.name} lacks the GGUF field {key!r}")
        return field.contents()

    def optional(self, key: str, default):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def tensor_bytes(self) -> int:
        """What the file's tensors take, as stored."""
        return sum(int(t.n_bytes) for t in self.tensors.values())

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def _rows(self, name: str) -> np.ndarray:
        """The tensor's raw rows (one per output channel), un-permuted."""
        data = np.asarray(self.tensors[name].data)
        if self.architecture != "llama":  # only llama's converter permutes
            return data
        if name.endswith("attn_q.weight"):
            return _unpermute_rows(data, self.num_heads)
        if name.endswith("attn_k.weight"):
            return _unpermute_rows(data, self.num_kv_heads)
        return data

    def float_tensor(self, name: str) -> torch.Tensor:
        """Any type gguf can de-quantize -> float32, in the tensor's logical shape."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        try:
            values = dequantize(self._rows(name), tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{self.path.name}: tensor {name} is {tensor.tensor_type.name}, which "
                f"the gguf package cannot read ({exc}); kvserve serves "
                f"{', '.join([*KEPT_QUANTIZED, *FLOAT_TYPES])} and expands the other "
                "types gguf reads") from None
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 first
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a copy: the file is mapped read-only

    def group_quant(self, name: str) -> GroupQuant:
        """A tensor of a kept type (KEPT_QUANTIZED) as integers and group scales,
        rows un-permuted (gguf_blocks.py)."""
        return decode(self.type_name(name), self._rows(name))


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the two rotary halves."""
    half = rows.shape[0] // heads // 2
    return (rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2)
            .reshape(rows.shape))
