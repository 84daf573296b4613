"""Architecture name (a Hugging Face config's `architectures`) -> the model class
that computes it. What each name implies for the config is in
engine/config/architectures.py; both list the same names."""
from __future__ import annotations

from kvserve.engine.config.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kvserve.engine.models.gemma import GemmaForCausalLM
from kvserve.engine.models.gpt_oss import GptOssForCausalLM
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.models.mixtral import MixtralForCausalLM
from kvserve.engine.models.phi3 import Phi3ForCausalLM
from kvserve.engine.models.qwen_moe import QwenMoeForCausalLM
from kvserve.modelstore.errors import ModelLoadError

MODEL_CLASSES: dict[str, type[DecoderModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[DecoderModel]:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise ModelLoadError(f"unsupported architecture {cfg.architecture!r}; kvserve "
                             f"supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return cls
