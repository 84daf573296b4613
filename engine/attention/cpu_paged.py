"""Decode attention over the paged cache on CPU, reading K/V where they lie.

The torch reference gathers each request's whole context out of the cache into a
new tensor in every layer, then calls SDPA on it. Here the same maths is written
with the gather inside the reductions (scores = q . K[slot], out = sum p * V[slot]),
and Inductor compiles it into loops that load each key and value straight from its
block: the only tensors written are the scores (Hq floats per context token, not
2 x Hkv x D). Two graphs, batch 1 and any other batch, each for any context length
(dynamic shapes), built from the torch wheel's own compiler: no C++ build step at
install time.

Scores and softmax are float32 whatever the cache's dtype, as in SDPA."""
from __future__ import annotations

import torch


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, Hq, D], one query per request at its last position; caches [N, bs, Hkv, D];
    block_tables [B, W] (int); seq_lens [B] (keys 0..len-1 are visible). -> [B, Hq, D]."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(block_tables.shape[1] * bs, device=q.device)
    slots = block_tables.long()[:, pos // bs] * bs + pos % bs  # [B, L]
    k = k_cache.reshape(-1, hkv, d)[slots].float()  # [B, L, Hkv, D]: fused, not stored
    v = v_cache.reshape(-1, hkv, d)[slots].float()
    qg = q.float().reshape(b, 1, hkv, hq // hkv, d)  # query heads grouped by KV head
    scores = (qg * k.unsqueeze(3)).sum(-1) * scale  # [B, L, Hkv, G]
    visible = (pos[None, :] < seq_lens[:, None].long())[:, :, None, None]
    p = scores.masked_fill(~visible, float("-inf")).softmax(dim=1)
    out = (p.unsqueeze(-1) * v.unsqueeze(3)).sum(1)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


_compiled = None


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    """paged_decode_reference compiled (once, for every batch size and length)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(paged_decode_reference, fullgraph=True)
    if block_tables.shape[1] == 1:  # no graph of its own for one-block contexts
        block_tables = torch.cat([block_tables, block_tables], dim=1)
    # Batch size and table width vary (a batch of one has a graph of its own).
    for t, dims in ((q, (0,)), (block_tables, (0, 1)), (seq_lens, (0,))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(t, dim)
    # Fresh views: the caches themselves are inputs of the model's compiled graphs,
    # which mark them static, and a static input is guarded on its identity (a
    # recompilation per layer). Always below autograd's view tracking, as inside a
    # compiled graph: the guards check the thread's dispatch state too, and a call
    # from eager code would otherwise be a recompilation.
    with torch.inference_mode(), torch._C._AutoDispatchBelowADInplaceOrView():
        return _compiled(q, k_cache.view(k_cache.shape), v_cache.view(v_cache.shape),
                         block_tables, seq_lens, scale)
