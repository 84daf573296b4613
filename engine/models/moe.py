"""The sparse mixture-of-experts block: a router picks each token's top-k experts
and the routed experts run as one fused op (engine/kernels/moe), beside an optional
shared expert every token goes through (Qwen2-MoE's, gated by a sigmoid).

Under tensor parallelism the experts are split across the ranks whole (expert
parallelism over the same process group): every rank routes every token, runs the
experts it holds, and one all-reduce sums the ranks' outputs. A shared expert is
split as the dense MLP is."""
from __future__ import annotations

import re

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.moe.fused_experts import (in_one_call, kernel_reads,
                                                      one_token_experts,
                                                      one_token_moe_experts)
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.layers import PlainWeight
from kvserve.engine.models.linear import Linear
from kvserve.engine.models.mlp import MLP
from kvserve.engine.models.quantized.int4 import quantize_int4
from kvserve.engine.models.quantized.int8 import quantize_int8
from kvserve.engine.models.tp_shard import SINGLE, TPShard

# A checkpoint's per-expert tensors, as transformers saves them.
_EXPERT = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_BIASES = {"w13": "b13", "w2": "b2"}


def expert_name(name: str, parts: dict[str, tuple[str, int]] = _PARTS,
                pattern: re.Pattern = _EXPERT) -> tuple[str, tuple[int, int]] | None:
    """`...experts.{e}.{projection}.{weight,bias}` -> (our stacked parameter,
    (e, part))."""
    m = pattern.match(name)
    if m is None:
        return None
    attr, part = parts[m.group(3)]
    if m.group(4) == "bias":
        attr = _BIASES[attr]
    return f"{m.group(1)}.{attr}", (int(m.group(2)), part)


class FusedExperts(nn.Module):
    """The routed experts this rank holds, stacked: w13 [E, 2I, H] (each expert's gate
    rows, then its up rows), w2 [E, H, I], and with `bias` b13 [E, 2I], b2 [E, H].
    Filled per checkpoint tensor through load_shard with shard (global expert id,
    part: 0 gate, 1 up; 0 for down)."""

    def __init__(self, num_experts: int, first: int, hidden: int, intermediate: int,
                 bias: bool = False, activation: tuple = ("silu", 0.0, 0.0)):
        super().__init__()
        self.first, self.intermediate = first, intermediate
        self.activation = activation  # (name, limit, alpha): fused_experts.gated's
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        # int8 experts' scales per output row (quantize_int8), or per group of
        # inputs with minimums (a GGUF's blocks, keep_groups); None while float.
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self.register_buffer("w13_min", None)
        self.register_buffer("w2_min", None)
        # x quantized to int8 where int8 experts meet it on CPU (fused_experts): set
        # by --quantization int8, whose rounding already departs from the checkpoint.
        self.int8_inputs = False

    def quantize_int8(self) -> None:
        """Each expert's rows rounded to int8 with a scale per output row, as
        Int8Linear rounds a projection (--quantization int8): half of bf16's bytes,
        and read as int8 by the batch-1 decode graph."""
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q, scales = quantize_int8(w.reshape(-1, w.shape[-1]), w.dtype)
            delattr(self, name)
            self.register_buffer(name, q.view(w.shape))
            self.register_buffer(f"{name}_scale", scales.view(w.shape[:2]))
        self.int8_inputs = True

    def quantize_int4(self, group_size: int) -> None:
        """Each expert's rows rounded to 4-bit codes with a scale and a minimum per
        group of `group_size` inputs, as Int4Linear rounds a projection (--quantization
        int4), kept as a GGUF's 4-bit experts are (two codes a byte, float32 group
        factors: keep_groups), so the same kernels read them."""
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            e, n, k = w.shape
            q, scales, mins = quantize_int4(w.reshape(e * n, k), group_size)
            codes = (q[:, 0::2] | (q[:, 1::2] << 4)).view(e, n, k // 2)
            self.keep_groups(name, codes, scales.t().float().reshape(e, n, -1).contiguous(),
                             mins.t().float().reshape(e, n, -1).contiguous())

    def keep_groups(self, name: str, q: torch.Tensor, scale: torch.Tensor,
                    low: torch.Tensor | None) -> None:
        """`name` (w13 or w2) as int8 values q [E, N, K] (or uint8 [E, N, K / 2], two
        4-bit codes a byte) with a float32 scale (and minimum) [E, N, G] per group of
        K / G inputs: a GGUF's expert blocks as they are (engine/weights/
        gguf_experts.py), w = q * scale + min."""
        shape = getattr(self, name).shape
        width = q.shape[-1] * (2 if q.dtype == torch.uint8 else 1)
        if (*q.shape[:2], width) != shape or scale.shape[:2] != q.shape[:2]:
            raise ValueError(f"{name}: codes {tuple(q.shape)} ({q.dtype}) with scales "
                             f"{tuple(scale.shape)}, expected {tuple(shape)}")
        delattr(self, name)
        self.register_buffer(name, q)
        setattr(self, f"{name}_scale", scale)
        setattr(self, f"{name}_min", low)

    def expected_shards(self, attr: str) -> list[tuple[int, int]]:
        experts = range(self.first, self.first + self.w13.shape[0])
        parts = (0, 1) if attr in ("w13", "b13") else (0,)
        return [(e, p) for e in experts for p in parts]

    def holds(self, shard: tuple[int, int]) -> bool:
        return self.first <= shard[0] < self.first + self.w13.shape[0]

    def load_shard(self, attr: str, shard: tuple[int, int], tensor: torch.Tensor) -> None:
        expert, part = shard[0] - self.first, shard[1]
        target = getattr(self, attr).data[expert]
        rows = slice(part * self.intermediate, (part + 1) * self.intermediate) \
            if attr in ("w13", "b13") else slice(None)
        if target[rows].shape != tensor.shape:
            raise ValueError(f"expert tensor of shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target[rows].shape)}")
        target[rows].copy_(tensor)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        args = (x, ids, weights, self.w13, self.w2, self.first, self.b13, self.b2,
                *self.activation, self.w13_scale, self.w2_scale, self.w13_min, self.w2_min)
        # One token in a compiled graph: kvserve::moe_experts itself where it takes the
        # experts in one call (8 of 64 experts of 1024 x 384 drawn from memory: bf16 at
        # 30-41 GB/s against the traced ops' 27-29, int8 at 20-23 against 15-19,
        # bench/moe_from_memory.py), the op (kvserve::expert_linear) for a GGUF's
        # group-quantized ones; else traced as plain ops (Inductor's loops read the
        # chosen experts where they lie).
        experts = (self.w13, self.w13_scale), (self.w2, self.w2_scale)
        if x.shape[0] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
            if in_one_call(self.activation[0], self.b13, self.b2, *experts):
                return one_token_moe_experts(x, ids, weights, self.w13, self.w2, self.first,
                                             self.w13_scale, self.w2_scale, self.w13_min,
                                             self.w2_min, self.int8_inputs)
            if not (self.w13_scale is not None and self.w13_scale.dim() == 3
                    and kernel_reads(*experts)):
                return one_token_experts(*args)
        return torch.ops.kvserve.fused_experts(*args, self.int8_inputs)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        # The router; DeepSeek's multiplies in float32, as a plain weight.
        self.gate = (PlainWeight(moe.num_experts, cfg.hidden_size)
                     if moe.router.startswith("grouped_")
                     else Linear(cfg.hidden_size, moe.num_experts, bias=moe.router_bias))
        # DeepSeek-V3's per-expert bias, added to the scores to choose, not to weigh.
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts))
                                        if moe.router == "grouped_sigmoid" else None)
        local = shard.experts(cfg)
        self.experts = FusedExperts(local, shard.rank * local, cfg.hidden_size,
                                    moe.intermediate_size, moe.expert_bias,
                                    (moe.activation, moe.swiglu_limit, moe.swiglu_alpha))
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, layer, shard, moe.shared_expert_intermediate_size)
        self.shared_expert_gate = (Linear(cfg.hidden_size, 1, bias=False)
                                   if moe.shared_expert_gate else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, K] and their weights [T, K]: a softmax over
        every expert in float32, the top k kept (renormalised if the config says);
        or (topk_softmax) the top k logits and a softmax over them; or DeepSeek's
        grouped routers (_grouped_sigmoid, _grouped_softmax)."""
        moe = self.moe
        if moe.router == "grouped_sigmoid":
            return self._grouped_sigmoid(x)
        if moe.router == "grouped_softmax":
            return self._grouped_softmax(x)
        logits = self.gate(x)
        if moe.router == "topk_softmax":
            top, ids = logits.topk(moe.top_k)
            return ids, torch.softmax(top, dim=-1)
        weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(moe.top_k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if moe.float32_weights else weights.to(logits.dtype)

    def _grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3: float32 sigmoid scores; each group of experts rated by its two
        best (biased) scores, the topk_group best groups kept, the top k experts
        chosen among theirs; weights: the unbiased scores, renormalised, scaled."""
        moe = self.moe
        weight = self.gate.weight
        scores = torch.sigmoid(torch.nn.functional.linear(x.float(), weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(len(x), moe.n_group, -1)
        group_best = groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_best).scatter_(
            1, group_best.topk(moe.topk_group, dim=-1).indices, 1.0)
        choice = groups.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(len(x), -1)
        ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * moe.routed_scaling_factor

    def _grouped_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V2: float32 softmax scores; with groups, only the topk_group
        groups of the highest single scores compete; the top k weighed by their
        scores times routed_scaling_factor (not renormalised)."""
        moe = self.moe
        scores = torch.nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1)
        if moe.n_group > 1:
            groups = scores.view(len(x), moe.n_group, -1)
            keep = torch.zeros(len(x), moe.n_group, device=x.device).scatter_(
                1, groups.amax(-1).topk(moe.topk_group, dim=-1).indices, 1.0)
            scores = groups.masked_fill(keep.unsqueeze(-1) == 0, 0.0).view(len(x), -1)
        weights, ids = scores.topk(moe.top_k, dim=-1)
        return ids, weights * moe.routed_scaling_factor

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        ids, weights = self.route(x)
        out = comm.all_reduce(self.experts(x, ids, weights))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)  # all-reduced by its down projection
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
