"""What the model is, as our own forward pass needs it: `ModelConfig`, read from a
Hugging Face `config.json` (through transformers' AutoConfig, which also normalises
old and new field names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelConfigError(ValueError):
    """The checkpoint's configuration is missing, malformed or unsupported."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's own dtype name, if stated
    # A Matryoshka embedding model's vector lengths that `dimensions` may ask for
    # (config key matryoshka_dimensions); () when any length works (is_matryoshka);
    # None when its vectors cannot be shortened.
    shorter_embeddings: tuple[int, ...] | None = None

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

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
            # Qwen2 always has q/k/v biases; Llama and Qwen3 follow attention_bias.
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=_rope_from_hf(hf),
            eos_token_ids=_eos_ids(hf),
            torch_dtype=_dtype_name(hf),
            shorter_embeddings=_matryoshka(hf),
        )


def _matryoshka(hf) -> tuple[int, ...] | None:
    dims = getattr(hf, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf, "is_matryoshka", False) else None


def _rope_from_hf(hf) -> RopeConfig:
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
    params = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = getattr(hf, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelConfigError(f"unsupported rope_scaling type {rope_type!r}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", 8192)
        ),
    )


def _eos_ids(hf) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _dtype_name(hf) -> str | None:
    dt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return None if dt is None else str(dt).replace("torch.", "")
