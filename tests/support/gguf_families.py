"""The GGUF families' tiny checkpoints for tests/engine/test_gguf_families*.py: each
family's shapes (every projection's inputs fill the K-quants' blocks of 256), its
llama.cpp architecture name, a Q4_K_M-like mix of types, the files written once per
process, and the fixtures over them."""
from __future__ import annotations

import gguf
import pytest
import torch

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.weights.loader import load_model
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.tiny_gguf import K_QUANT_SHAPES, write_gguf_dir
from tests.support.tiny_models import make_tiny_model

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
# Every projection's inputs fill the K-quants' blocks of 256; every MoE layer sparse
# (a GGUF has no key for dense layers among sparse ones); windows shorter than the
# prompts.
SHAPES = {"qwen3moe": dict(K_QUANT_SHAPES, head_dim=64, moe_intermediate_size=256,
                           num_experts=6, decoder_sparse_step=1, num_hidden_layers=2),
          "qwen2moe": dict(K_QUANT_SHAPES, moe_intermediate_size=256, num_experts=6,
                           shared_expert_intermediate_size=256, mlp_only_layers=[],
                           num_hidden_layers=2),
          "mixtral": dict(K_QUANT_SHAPES, intermediate_size=256, num_local_experts=6,
                          num_hidden_layers=2),
          "gemma2": dict(K_QUANT_SHAPES, head_dim=64, query_pre_attn_scalar=64,
                         sliding_window=12),
          "gemma3": dict(K_QUANT_SHAPES, head_dim=64, query_pre_attn_scalar=64,
                         sliding_window=12),
          "gptoss": dict(K_QUANT_SHAPES, head_dim=64, intermediate_size=256,
                         sliding_window=12),
          "phi3": dict(K_QUANT_SHAPES, sliding_window=12, rope_scaling={
              "rope_type": "longrope", "short_factor": [1.0 + i / 64 for i in range(32)],
              "long_factor": [2.0 + i / 16 for i in range(32)]})}
# DeepSeek's latent widths fill the K-quants' blocks where they are a projection's
# inputs (q_lora_rank, heads x v_head_dim); kv_b_proj's parts are Q8_0 (deepseek_mix).
DEEPSEEK_SHAPES = dict(K_QUANT_SHAPES, num_key_value_heads=4, num_hidden_layers=2,
                       first_k_dense_replace=1, n_routed_experts=8, moe_intermediate_size=256,
                       kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                       v_head_dim=64)
SHAPES.update(deepseekv3=dict(DEEPSEEK_SHAPES, q_lora_rank=256, head_dim=32),
              deepseekv2=dict(DEEPSEEK_SHAPES, head_dim=32))
MOE = ("qwen3moe", "qwen2moe", "mixtral", "gptoss")
# llama.cpp's architecture names (Mixtral is a `llama` file with experts).
GGUF_ARCH = {"qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "mixtral": "llama",
             "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "gptoss": "gpt-oss",
             "deepseekv3": "deepseek2", "deepseekv2": "deepseek2"}
ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gptoss": "GptOssForCausalLM", "deepseekv3": "DeepseekV3ForCausalLM",
                 "deepseekv2": "DeepseekV2ForCausalLM"}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11] * 4, [5, 17, 42, 99, 7, 3, 250, 11] * 3 + [9]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def q4_k_m(name: str):
    """llama-quantize's Q4_K_M, roughly: 4-bit projections and experts, 6-bit down
    projections, values and head, the router in F32."""
    if "ffn_gate_inp" in name:
        return T.F32
    if "ffn_down" in name or "attn_v" in name or name == "output.weight":
        return T.Q6_K
    return T.Q4_K


def gpt_oss_mix(name: str):
    """gpt-oss's experts in MXFP4, as its checkpoints and GGUF files hold them."""
    return T.MXFP4 if "_exps" in name else q4_k_m(name)


def deepseek_mix(name: str):
    """kv_b_proj's parts (attn_k_b's inputs are a head's 32 key dims) in Q8_0, their
    blocks of 32 (llama-quantize keeps them at 8 bits or more too); the rest Q4_K_M."""
    return T.Q8_0 if "attn_k_b" in name or "attn_v_b" in name else q4_k_m(name)


MIXES = {"gptoss": gpt_oss_mix, "deepseekv3": deepseek_mix, "deepseekv2": deepseek_mix}
_made: dict = {}


def made_family(arch: str, tmp_path_factory):
    """(architecture, float checkpoint, its GGUF in F32, its GGUF as Q4_K_M)."""
    if arch not in _made:
        root = tmp_path_factory.mktemp(arch)
        float_dir = make_tiny_model(root / "hf", arch, **SHAPES[arch])
        _made[arch] = (arch, float_dir,
                       write_gguf_dir(float_dir, root / "f32", lambda n: T.F32, GGUF_ARCH[arch]),
                       write_gguf_dir(float_dir, root / "q4km", MIXES.get(arch, q4_k_m),
                                      GGUF_ARCH[arch]))
    return _made[arch]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request, tmp_path_factory):
    return made_family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=MOE)
def moe(request, tmp_path_factory):
    return made_family(request.param, tmp_path_factory)


def load(model_dir, quantization):
    cfg = ModelConfig.from_pretrained(model_dir)
    return load_model(model_dir, cfg, torch.float32, CPU, 256, "gguf", 0, quantization)
