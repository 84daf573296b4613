"""Each tensor-parallel rank loads exactly its part of the checkpoint: its query heads,
its KV heads (split, or the one its query heads read when there are fewer KV heads
than ranks), its intermediate features, its vocabulary rows (the last share padded
with zeros), and the whole of the norms."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.tp_shard import TPShard
from kvserve.engine.weights.loader import load_model


def _load(model_dir, shard: TPShard):
    cfg = ModelConfig.from_pretrained(model_dir)
    return cfg, load_model(model_dir, cfg, torch.float32, torch.device("cpu"), 256,
                           "safetensors", shard=shard)


@pytest.mark.parametrize("size", [2, 6])  # 6 ranks, 2 KV heads: each KV head on 3 ranks
def test_each_rank_holds_its_rows_and_columns(tiny_model_dir, size):
    model_dir = tiny_model_dir("llama")
    cfg, full = _load(model_dir, TPShard())
    d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_full, k_full, v_full = full.layers[0].self_attn.qkv_proj.weight.split(
        [h * d, kv * d, kv * d])
    qs, keys = [], []
    for rank in range(size):
        shard = TPShard(rank, size)
        _, part = _load(model_dir, shard)
        attn, mlp = part.layers[0].self_attn, part.layers[0].mlp
        heads, kv_heads = h // size, max(1, kv // size)
        assert (attn.num_heads, attn.num_kv_heads) == (heads, kv_heads)
        q, k, v = attn.qkv_proj.weight.split([heads * d, kv_heads * d, kv_heads * d])
        first_kv = rank * kv // size
        # The KV head this rank's query heads read under grouped-query attention.
        assert (rank * heads) // (h // kv) == first_kv
        assert torch.equal(k, k_full[first_kv * d:(first_kv + kv_heads) * d])
        assert torch.equal(v, v_full[first_kv * d:(first_kv + kv_heads) * d])
        qs.append(q)
        keys.append(first_kv)
        o_cols = full.layers[0].self_attn.o_proj.weight[:, rank * heads * d:(rank + 1) * heads * d]
        assert torch.equal(attn.o_proj.weight, o_cols)
        inter = cfg.intermediate_size // size
        gate_full, up_full = full.layers[0].mlp.gate_up_proj.weight.chunk(2)
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, gate_full[rank * inter:(rank + 1) * inter])
        assert torch.equal(up, up_full[rank * inter:(rank + 1) * inter])
        assert torch.equal(mlp.down_proj.weight,
                           full.layers[0].mlp.down_proj.weight[:, rank * inter:(rank + 1) * inter])
        rows = shard.vocab(cfg)
        start, real = rank * rows, min(rows, cfg.vocab_size - rank * rows)
        assert part.embed_tokens.weight.shape[0] == rows
        assert torch.equal(part.embed_tokens.weight[:real],
                           full.embed_tokens.weight[start:start + real])
        assert not part.embed_tokens.weight[real:].any()  # padding
        assert torch.equal(part.lm_head.weight[:real], full.lm_head.weight[start:start + real])
        assert torch.equal(part.norm.weight, full.norm.weight)
    assert torch.equal(torch.cat(qs), q_full)
    assert sorted(set(keys)) == list(range(kv))


def test_what_cannot_be_split_is_named():
    from kvserve.modelstore.errors import ModelLoadError

    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 96, 1, num_heads=8, num_kv_heads=3,
                      head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64)
    with pytest.raises(ModelLoadError, match="8 attention heads"):
        TPShard(0, 3).check(cfg)
    with pytest.raises(ModelLoadError, match="3 KV heads"):
        TPShard(0, 2).check(cfg)
