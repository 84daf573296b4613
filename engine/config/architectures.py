"""What each supported Hugging Face architecture name means for ModelConfig: the
fields its config leaves implicit (Qwen2's q/k/v biases, Qwen3's QK-norm) and how
its experts are described. The model class of each lives in engine/models/registry.py,
which covers exactly these names (tests/engine/test_model_registry.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine.config import moe_config
from kvserve.engine.config.mla_config import MLAConfig, mla_from_hf
from kvserve.engine.config.moe_config import MoEConfig


@dataclass(frozen=True)
class ArchitectureTraits:
    # q/k/v biases: always (Qwen2), or as `attention_bias` says (None)
    qkv_bias: bool | None = None
    qk_norm: bool = False
    moe: Callable[[object], MoEConfig] | None = None
    mla: Callable[[object], MLAConfig] | None = None
    attention_sinks: bool = False
    # The config's max_position_embeddings is the context after rope scaling
    # already (Gemma 3's, as vLLM reads it), not to be multiplied by the factor.
    context_states_scaling: bool = False


ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "LlamaForCausalLM": ArchitectureTraits(),
    "MistralForCausalLM": ArchitectureTraits(),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureTraits(qk_norm=True),
    "MixtralForCausalLM": ArchitectureTraits(moe=moe_config.mixtral),
    "Qwen2MoeForCausalLM": ArchitectureTraits(qkv_bias=True, moe=moe_config.qwen_moe),
    "Qwen3MoeForCausalLM": ArchitectureTraits(qk_norm=True, moe=moe_config.qwen_moe),
    "Gemma2ForCausalLM": ArchitectureTraits(),
    "Gemma3ForCausalLM": ArchitectureTraits(qk_norm=True, context_states_scaling=True),
    "GptOssForCausalLM": ArchitectureTraits(moe=moe_config.gpt_oss, attention_sinks=True),
    "Phi3ForCausalLM": ArchitectureTraits(),
    "DeepseekV2ForCausalLM": ArchitectureTraits(moe=moe_config.deepseek_v2, mla=mla_from_hf),
    "DeepseekV3ForCausalLM": ArchitectureTraits(moe=moe_config.deepseek_v3, mla=mla_from_hf),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def qkv_bias(traits: ArchitectureTraits, hf) -> bool:
    if traits.qkv_bias is not None:
        # Qwen2-MoE's config names the switch (default on); Qwen2's has none.
        return bool(getattr(hf, "qkv_bias", traits.qkv_bias))
    return bool(getattr(hf, "attention_bias", False))
