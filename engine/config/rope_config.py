"""Rotary position embedding parameters, read from a Hugging Face config's
`rope_parameters` (transformers >= 5) or `rope_scaling` (older files), and the
context length they allow (`scaled_max_len`, the way vLLM derives max_model_len)."""
from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class RopeConfigError(ValueError):
    """The rope scaling named in the config is unknown or incomplete."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and extrapolated bands, and the factor cos
    # and sin are scaled by (None: derived from factor, mscale and mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope: one rescale factor per frequency, for positions inside the original
    # context (short) and beyond it (long)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # The model's own max_position_embeddings (dynamic NTK and longrope scale by it).
    max_position_embeddings: int = 0
    # Rotary dims of a head: head_dim x partial_rotary_factor (the rest pass through).
    partial_rotary_factor: float = 1.0


def rope_from_hf(hf, layer_type: str = "full_attention") -> RopeConfig:
    """layer_type: which layers' rope, where the config keys its parameters by layer
    type (Gemma 3: a local base for sliding layers, a global one for full layers)."""
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if layer_type in params:
        params = dict(params[layer_type])
    scaling = getattr(hf, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise RopeConfigError(f"unsupported rope_scaling type {rope_type!r}; kvserve "
                              f"supports {', '.join(ROPE_TYPES)}")
    max_pos = int(getattr(hf, "max_position_embeddings", 0) or 0)
    # As transformers standardises it: the config's own field first (Phi-3 saves it
    # there), then the rope parameters', then the stated context.
    original = (getattr(hf, "original_max_position_embeddings", None)
                or params.get("original_max_position_embeddings") or max_pos)
    if rope_type == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise RopeConfigError("longrope scaling needs short_factor and long_factor")
    return RopeConfig(
        theta=float(theta), rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        attention_factor=_optional_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        max_position_embeddings=max_pos,
        partial_rotary_factor=float(params.get("partial_rotary_factor")
                                    or getattr(hf, "partial_rotary_factor", None) or 1.0),
    )


def scaled_max_len(max_position_embeddings: int, rope: RopeConfig) -> int:
    """The context the model serves: as vLLM derives it, the pretrained context times
    the scaling factor for linear, dynamic and yarn scaling (from
    original_max_position_embeddings where the config names it, since such configs
    may already state the scaled length as max_position_embeddings); as stated for
    default, llama3 and longrope."""
    if rope.rope_type in ("default", "llama3", "longrope") or rope.factor <= 1.0:
        return max_position_embeddings
    base = max_position_embeddings
    if rope.rope_type == "yarn":
        base = rope.original_max_position_embeddings
    return max(max_position_embeddings, int(base * rope.factor))


def _optional_float(value) -> float | None:
    return None if value is None else float(value)
