"""What the model is, as our own forward pass needs it: `ModelConfig`, read from a
Hugging Face `config.json` (through transformers' AutoConfig, which also normalises
old and new field names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvserve.engine.config.architectures import (ARCHITECTURES, SUPPORTED_ARCHITECTURES,
                                                 qkv_bias)
from kvserve.engine.config.mla_config import MLAConfig
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
    mla: MLAConfig | None = None  # multi-head latent attention's shapes
    # Sliding-window attention: the window (0: none), on every layer, or where
    # layer_types (one "sliding_attention" / "full_attention" a layer) says.
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    # The sliding layers' own rope (Gemma 3's local base), None: the model's rope.
    local_rope: RopeConfig | None = None
    attn_softcap: float = 0.0  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float = 0.0  # ... and of the logits
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power, not head_dim's
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    hidden_act: str = "silu"  # the MLP's gate activation
    # False where max_position_embeddings is the scaled context already (Gemma 3).
    rope_scales_context: bool = True
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's own dtype name, if stated
    # A Matryoshka embedding model's vector lengths that `dimensions` may ask for
    # (config key matryoshka_dimensions); () when any length works (is_matryoshka);
    # None when its vectors cannot be shortened.
    shorter_embeddings: tuple[int, ...] | None = None

    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(tensors a layer's cache has, heads, values a head): K and V of every KV
        head; or, with latent attention, one tensor of one latent per token."""
        if self.mla is not None:
            return 1, 1, self.mla.cache_dim
        return 2, self.num_kv_heads, self.head_dim

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for full attention."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    @property
    def max_model_len(self) -> int:
        """The context the rope scaling allows (rope_config.scaled_max_len)."""
        if not self.rope_scales_context:
            return self.max_position_embeddings
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
            from kvserve.engine.platform.gguf_config import hf_config
            from kvserve.modelstore.errors import ModelLoadError

            try:
                return ModelConfig.from_hf(hf_config(GGUFCheckpoint(path)))
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
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias(traits, hf),
            o_bias=attention_bias and traits.qkv_bias is None,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=traits.qk_norm,
            rope=_rope(hf),
            moe=traits.moe(hf) if traits.moe else None,
            mla=traits.mla(hf) if traits.mla else None,
            **_attention_fields(hf, traits),
            eos_token_ids=_eos_ids(hf),
            torch_dtype=_dtype_name(hf),
            shorter_embeddings=_matryoshka(hf),
        )


def _matryoshka(hf) -> tuple[int, ...] | None:
    dims = getattr(hf, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf, "is_matryoshka", False) else None


def _rope(hf, layer_type: str = "full_attention") -> RopeConfig:
    try:
        return rope_from_hf(hf, layer_type)
    except RopeConfigError as exc:
        raise ModelConfigError(str(exc)) from exc


def _attention_fields(hf, traits) -> dict:
    """Windows, soft-caps, sinks and the like, where the family has them."""
    window = int(getattr(hf, "sliding_window", None) or 0)
    if not getattr(hf, "use_sliding_window", True):  # Qwen2's switch
        window = 0
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    params = getattr(hf, "rope_parameters", None) or {}
    return dict(
        sliding_window=window, layer_types=layer_types,
        local_rope=_rope(hf, "sliding_attention") if "sliding_attention" in params else None,
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        query_pre_attn_scalar=float(getattr(hf, "query_pre_attn_scalar", None) or 0.0),
        attention_sinks=traits.attention_sinks,
        hidden_act=(getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
                    or "silu"),
        rope_scales_context=not traits.context_states_scaling,
    )


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _dtype_name(hf) -> str | None:
    dt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return None if dt is None else str(dt).replace("torch.", "")
