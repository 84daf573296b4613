"""A decoder-only (Llama-family) model's sizes from its Hugging Face config.json, and
where that file is: a path, a model directory, or a preset name shipped under
modelstore/presets/NAME/config.json (read as a file; engine's Python is never imported)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The model dtype: embeddings, LM head, norms, and every weight left unquantized
# (--quantization: modelstore/weight_bytes.py). The KV cache may be fp8 too.
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict) -> ModelShape:
        heads = cfg["num_attention_heads"]
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], heads,
                   cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   cfg["intermediate_size"], cfg["vocab_size"],
                   bool(cfg.get("tie_word_embeddings", False)))

    def layer_params(self) -> int:
        """q, k, v, o projections, gate/up/down MLP, two RMSNorms."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def params(self) -> int:
        tables = self.embedding_params() * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params() + tables + self.hidden_size

    def matmul_params(self) -> int:
        """Weights every token multiplies with: all but the input embedding lookup
        (the output head is always a matmul, tied or not)."""
        return self.num_layers * self.layer_params() + self.embedding_params()

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def presets_dir() -> Path:
    """modelstore/presets (plain files; modelstore imports neither torch nor engine)."""
    from kvserve.modelstore.presets import PRESETS_DIR

    return PRESETS_DIR


def config_path(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    name = model.removeprefix("preset:")
    root = presets_dir()
    if (root / name / "config.json").is_file():
        return root / name / "config.json"
    known = sorted(p.parent.name for p in root.glob("*/config.json"))
    raise FileNotFoundError(f"no config.json at {model!r} and no such preset "
                            f"(known: {', '.join(known) or 'none'})")


def load_shape(model: str) -> ModelShape:
    return ModelShape.from_config(json.loads(config_path(model).read_text()))
