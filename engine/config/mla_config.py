"""Multi-head latent attention's shapes (DeepSeek-V2/V3, Kimi-K2): queries through an
optional low-rank bottleneck, keys and values compressed into one latent vector per
token plus a shared rotary key part, which is all the paged cache holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int  # the latent's size
    qk_nope_head_dim: int  # a head's key/query dims without position
    qk_rope_head_dim: int  # ... and with it (one rotary key shared by every head)
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries projected directly (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # rotary dims paired (0,1), (2,3) ... as DeepSeek lays them

    @property
    def cache_dim(self) -> int:
        """Values per token a layer's cache holds: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_from_hf(hf) -> MLAConfig:
    return MLAConfig(kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                     qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                     q_lora_rank=int(getattr(hf, "q_lora_rank", None) or 0),
                     rope_interleave=bool(getattr(hf, "rope_interleave", True)))
