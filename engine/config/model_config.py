"""What the model is, as our own forward pass needs it: `ModelConfig`, read from a
Hugging Face `config.json` (through transformers' AutoConfig, which also normalises
old and new field names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvserve.engine.config.architectures import (ARCHITECTURES, SUPPORTED_ARCHITECTURES,
                                                 qkv_bias)
from kvserve.engine.config.moe_config import MoEConfig
from kvserve.engine.config.rope_config import (RopeConfig, RopeConfigError, rope_from_hf,
                                               scaled_max_len)

__all__ = ["ModelConfig", "ModelConfigError", "MoEConfig", "RopeConfig",
           "SUPPORTED_ARCHITECTURES"]

class ModelConfigError(ValueError):
    """The checkpoint's configuration is missing, malformed or unsupported."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    moe: MoEConfig | None = None  # a mixture-of-experts model's routing and experts
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's own dtype name, if stated
    # A Matryoshka embedding model's vector lengths that `dimensions` may ask for
    # (config key matryoshka_dimensions); () when any length works (is_matryoshka);
    # None when its vectors cannot be shortened.
    shorter_embeddings: tuple[int, ...] | None = None

    @property
    def max_model_len(self) -> int:
        """The context the rope scaling allows (rope_config.scaled_max_len)."""
        return scaled_max_len(self.max_position_embeddings, self.rope)

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> "ModelConfig":
        """`model_dir` is a model directory, `preset:NAME` (modelstore/presets), or a
        .gguf file (its config read from the file's metadata)."""
        from kvserve.modelstore.presets import resolve_model_path

        try:
            path = resolve_model_path(model_dir)
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from exc
        if path.suffix == ".gguf" and path.is_file():
            from kvserve.engine.platform.gguf_checkpoint import GGUFCheckpoint
            from kvserve.modelstore.errors import ModelLoadError

            try:
                return ModelConfig.from_hf(GGUFCheckpoint(path).hf_config())
            except ModelLoadError as exc:
                raise ModelConfigError(str(exc)) from exc
        if not (path / "config.json").is_file():
            raise ModelConfigError(f"no config.json in model directory {path}")
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(str(path))
        except Exception as exc:  # malformed json, unknown model_type, ...
            raise ModelConfigError(f"cannot read {path / 'config.json'}: {exc}") from exc
        return ModelConfig.from_hf(hf)

    @staticmethod
    def from_hf(hf) -> "ModelConfig":
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architecture {archs or hf.model_type!r}; "
                f"kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        traits = ARCHITECTURES[arch]
        heads = hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        max_pos = hf.max_position_embeddings
        # Mistral-style sliding windows are not implemented: cap the context instead
        # so results stay exact.
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True):
            max_pos = min(max_pos, window)
        return ModelConfig(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias(traits, hf),
            o_bias=attention_bias and traits.qkv_bias is None,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=traits.qk_norm,
            rope=_rope(hf),
            moe=traits.moe(hf) if traits.moe else None,
            eos_token_ids=_eos_ids(hf),
            torch_dtype=_dtype_name(hf),
            shorter_embeddings=_matryoshka(hf),
        )


def _matryoshka(hf) -> tuple[int, ...] | None:
    dims = getattr(hf, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf, "is_matryoshka", False) else None


def _rope(hf) -> RopeConfig:
    try:
        return rope_from_hf(hf)
    except RopeConfigError as exc:
        raise ModelConfigError(str(exc)) from exc


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _dtype_name(hf) -> str | None:
    dt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return None if dt is None else str(dt).replace("torch.", "")
