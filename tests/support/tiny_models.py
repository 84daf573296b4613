"""Tiny random-weight Hugging Face model directories, made on the fly.

Each has its own small byte-level BPE tokenizer with a ChatML template, so tests of
the engine and server need no download and no default model."""
from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Continuous batching keeps the accelerator busy by letting requests join and leave.",
    "Paged attention stores keys and values in fixed-size blocks, like virtual memory.",
    "Héllo wörld — naïve café, 東京 and emoji 🙂 are multi-byte characters.",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 20

ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3rope": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 256},
                       rope_theta=500000.0),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=24),
    # Mixture-of-experts: enough experts that a batch leaves some idle, top-k > 1.
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    num_local_experts=6, num_experts_per_tok=2, sliding_window=None),
    "qwen2moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                     shared_expert_intermediate_size=64, norm_topk_prob=False,
                     num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     head_dim=24, num_experts=8, num_experts_per_tok=3,
                     moe_intermediate_size=48, norm_topk_prob=True, num_hidden_layers=4,
                     decoder_sparse_step=2),
    # Sliding windows shorter than most test prompts (24 tokens), so they matter.
    "mistralwin": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                       sliding_window=24),
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
                   query_pre_attn_scalar=24, sliding_window=24, attn_logit_softcapping=20.0,
                   final_logit_softcapping=15.0, num_hidden_layers=3,
                   tie_word_embeddings=True),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   head_dim=16, query_pre_attn_scalar=16, sliding_window=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   num_hidden_layers=3, tie_word_embeddings=True,
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
    "gptoss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=16,
                   num_local_experts=6, num_experts_per_tok=2, intermediate_size=48,
                   sliding_window=24, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=40,
                 original_max_position_embeddings=1024,
                 rope_scaling={"rope_type": "longrope",
                               "short_factor": [1.0 + i / 32 for i in range(8)],
                               "long_factor": [2.0 + i / 8 for i in range(8)]}),
    # Latent attention and grouped routing; YaRN with DeepSeek's mscale, prompts
    # past its original context.
    "deepseekv3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                       num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                       n_group=4, topk_group=2, first_k_dense_replace=1,
                       moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=32,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                       routed_scaling_factor=2.5, max_position_embeddings=256,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 64,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                     "mscale_all_dim": 1.0}),
    # DeepSeek-V2-Lite's shape: queries without the low-rank bottleneck; softmax
    # routing limited to the best groups.
    "deepseekv2": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                       num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                       n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
                       topk_method="group_limited_greedy", n_group=4, topk_group=2,
                       first_k_dense_replace=1, moe_intermediate_size=32, q_lora_rank=None,
                       kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                       v_head_dim=16, routed_scaling_factor=1.5, head_dim=8),
    # Long-context RoPE: YaRN over a short original context, so prompts pass it.
    "qwen2yarn": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                      max_position_embeddings=256,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}),
}


def make_tokenizer(path: Path, extra_tokens: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.add_tokens(list(extra_tokens))  # whole strings a test wants as one token
    fast.chat_template = CHATML
    fast.save_pretrained(str(path))
    return fast


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0,
                    extra_tokens: tuple[str, ...] = (), dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    """Writes config.json, model.safetensors (weights in `dtype`) and tokenizer files
    into `path`; `extra_tokens` become tokens of their own, after the trained
    vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path, extra_tokens)
    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    fields = dict(vocab_size=len(tok), hidden_size=96, intermediate_size=192,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=4096, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  initializer_range=0.1)
    fields.update(spec)
    fields.update(overrides)
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dtype)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros as made: make it count
            buffer.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    return path
