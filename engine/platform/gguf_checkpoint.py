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
# GGUF architecture -> (transformers config class, our architecture name). Qwen2's
# q/k/v biases and Qwen3's QK-norm are tensors of their own in the file.
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


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
        self.architecture = self._field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ModelLoadError(f"{path.name}: GGUF architecture {self.architecture!r} "
                                 f"is not supported; kvserve reads {', '.join(ARCHITECTURES)} "
                                 "GGUF files (or serve the model's safetensors directory)")
        self.num_heads = int(self._field(self._key("attention.head_count")))
        self.num_kv_heads = int(self._field(self._key("attention.head_count_kv")))

    def _key(self, name: str) -> str:
        """A metadata key of the file's architecture (llama.embedding_length, ...)."""
        return f"{self.architecture}.{name}"

    def _field(self, key: str):
        field = self.reader.fields.get(key)
        if field is None:
            raise ModelLoadError(f"{self.path.name} lacks the GGUF field {key!r}")
        return field.contents()

    def hf_config(self):
        """The model's Hugging Face config, from the file's metadata alone (a .gguf
        served with no config.json beside it)."""
        import transformers

        if "rope_freqs.weight" in self.tensors:
            raise ModelLoadError(f"{self.path.name} scales RoPE by a rope_freqs tensor "
                                 "(Llama 3.1-style); serve it from a directory holding the "
                                 "model's config.json and the file (--load-format gguf)")
        hidden = int(self._field(self._key("embedding_length")))
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._optional(self._key("vocab_size"), len(tokens.data) if tokens else None)
        head_dim = self._optional(self._key("attention.key_length"),
                                  self._optional(self._key("rope.dimension_count"),
                                                 hidden // self.num_heads))
        config_class, architecture = ARCHITECTURES[self.architecture]
        return getattr(transformers, config_class)(
            architectures=[architecture], vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(self._field(self._key("feed_forward_length"))),
            num_hidden_layers=int(self._field(self._key("block_count"))),
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=_decimal(self._field(self._key("attention.layer_norm_rms_epsilon"))),
            max_position_embeddings=int(self._field(self._key("context_length"))),
            rope_theta=_decimal(self._optional(self._key("rope.freq_base"), 10000.0)),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self._optional("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self._optional("tokenizer.ggml.eos_token_id", None))

    def _optional(self, key: str, default):
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


def _decimal(value) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not
    9.999999747378752e-06), so the config matches the model's own config.json."""
    return float(str(np.float32(value)))


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of the two rotary halves."""
    half = rows.shape[0] // heads // 2
    return (rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2)
            .reshape(rows.shape))
