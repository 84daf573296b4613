"""A mixture-of-experts model's routing and expert shapes, read from its Hugging Face
config (each family names them its own way)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # Which decoder layers have the sparse block (the others a dense MLP of the
    # model's intermediate_size): Qwen's decoder_sparse_step / mlp_only_layers.
    sparse_layers: tuple[bool, ...]
    # The chosen experts' softmax weights renormalised to sum to 1.
    norm_topk_prob: bool = True
    # A dense expert every token goes through beside the routed ones (0: none), and
    # whether a sigmoid of its own linear gate scales it (Qwen2-MoE).
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # The routing weights multiply the experts' outputs in float32 (Mixtral's
    # router keeps them so); else they are cast to the model's dtype first (Qwen's).
    float32_weights: bool = False
    # "softmax": a softmax over every expert, then the top k (Mixtral, Qwen);
    # "topk_softmax": the top k logits, then a softmax over those k (gpt-oss);
    # "grouped_sigmoid": DeepSeek-V3's sigmoid scores, biased for the choice only,
    # the top k taken within the topk_group best of n_group expert groups, scaled by
    # routed_scaling_factor (router logits in float32);
    # "grouped_softmax": DeepSeek-V2's softmax scores, the top k taken within the
    # topk_group groups of the highest single score (group_limited_greedy; one group
    # of all: greedy), scaled by routed_scaling_factor.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False  # biases on each expert's projections (gpt-oss)
    # The experts' gated activation: "silu" (SwiGLU), or "swiglu_oai" (gpt-oss's:
    # gate clamped above at swiglu_limit, up clamped to +-swiglu_limit,
    # gate * sigmoid(swiglu_alpha * gate) * (up + 1)).
    activation: str = "silu"
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


def _sparse_layers(hf, num_experts: int) -> tuple[bool, ...]:
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                 for i in range(hf.num_hidden_layers))


def qwen_moe(hf) -> MoEConfig:
    """Qwen2-MoE and Qwen3-MoE (Qwen2's shared expert is a field of its config)."""
    shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    return MoEConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                     intermediate_size=hf.moe_intermediate_size,
                     sparse_layers=_sparse_layers(hf, hf.num_experts),
                     norm_topk_prob=bool(hf.norm_topk_prob),
                     shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)


def mixtral(hf) -> MoEConfig:
    return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                     intermediate_size=hf.intermediate_size,
                     sparse_layers=(True,) * hf.num_hidden_layers, norm_topk_prob=True,
                     float32_weights=True)


def gpt_oss(hf) -> MoEConfig:
    return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                     intermediate_size=hf.intermediate_size,
                     sparse_layers=(True,) * hf.num_hidden_layers, router="topk_softmax",
                     router_bias=True, expert_bias=True, activation="swiglu_oai",
                     swiglu_limit=float(getattr(hf, "swiglu_limit", 7.0)),
                     swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)))


def deepseek_v3(hf) -> MoEConfig:
    first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    step = int(getattr(hf, "moe_layer_freq", 1) or 1)
    return MoEConfig(num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok,
                     intermediate_size=hf.moe_intermediate_size,
                     sparse_layers=tuple(i >= first_dense and i % step == 0
                                         for i in range(hf.num_hidden_layers)),
                     norm_topk_prob=bool(hf.norm_topk_prob),
                     shared_expert_intermediate_size=hf.moe_intermediate_size * int(
                         getattr(hf, "n_shared_experts", 0) or 0),
                     router="grouped_sigmoid", n_group=int(hf.n_group or 1),
                     topk_group=int(hf.topk_group or 1),
                     routed_scaling_factor=float(hf.routed_scaling_factor or 1.0))


def deepseek_v2(hf) -> MoEConfig:
    greedy = getattr(hf, "topk_method", "greedy") == "greedy"
    return MoEConfig(num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok,
                     intermediate_size=hf.moe_intermediate_size,
                     sparse_layers=tuple(i >= int(hf.first_k_dense_replace or 0)
                                         for i in range(hf.num_hidden_layers)),
                     norm_topk_prob=False,
                     shared_expert_intermediate_size=hf.moe_intermediate_size * int(
                         getattr(hf, "n_shared_experts", 0) or 0),
                     router="grouped_softmax",
                     n_group=1 if greedy else int(hf.n_group or 1),
                     topk_group=1 if greedy else int(hf.topk_group or 1),
                     routed_scaling_factor=float(hf.routed_scaling_factor or 1.0))
