"""Decode attention over the paged cache on CPU, reading K/V where they lie.

The torch reference gathers each request's whole context out of the cache into a
new tensor in every layer, then calls SDPA on it. Here the same maths is written
with the gather inside the reductions (scores = q . K[block], out = sum p * V[block]),
and Inductor compiles it into loops that load each key and value straight from its
block: the only tensors written are the scores (Hq floats per context token, not
2 x Hkv x D). Built from the torch wheel's own compiler: no C++ build step at
install time.

For float32 and bf16 caches, where this process has kvserve's CPU kernels
(engine/kernels/cpu, --cpu-kernels), the attention itself is the op kvserve::paged_decode
instead (`attend`): the same maths in one pass over a request's keys and one over its
values, 1.8-3x faster at 16-28 requests of 150-550 positions in float32 on a 2-core
AVX2 CPU, 2.3-3.7x in bf16 on an AVX512-BF16 one. The ops below stay its reference,
and serve fp8 caches.

It runs two ways:
- inside the compiled decode graphs (`decode_in_place`, called by the model when a
  step hands it a `PagedDecode`): the store of the new K/V and the attention are
  traced with the rest of the decoder, so a decode step is one graph with no Python
  between its layers (on CPU no CUDA graph hides the per-layer cost of leaving a
  graph for a custom op: ~0.18 ms a layer, a third of a batch-1 step);
- as a function compiled on its own (`paged_decode`), for the decodes of mixed steps,
  which reach it through the attention custom op.

Scores and softmax are float32 whatever the cache's dtype, as in SDPA. An fp8
cache's scales are applied once per score and once per output row, not per value
read (q.(s K) = s (q.K)). Its values are converted to float32 as they are loaded,
one at a time, which costs more than the bytes it saves here: at batch 1 an fp8
layer's attention took 1.5x (128 keys) to 2.7x (1024 keys) a bf16 one's
(bench/results/kv_fp8_cpu_2026-11-24.md), and the bf16 one has been 4-12x faster
since it reads whole blocks. On CPU an fp8 cache buys capacity."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvserve.engine.kernels.attention import score_mods
from kvserve.engine.kernels.cpu import build as cpu_kernels
from kvserve.engine.kernels.fp8_cache import store_rows


class PagedDecode(NamedTuple):
    """A decode-only step's attention inputs, as graph inputs: one row per request."""
    block_tables: torch.Tensor  # [B, W] int32 (W >= 2: see `widened`)
    seq_lens: torch.Tensor  # [B] int32, the new token included
    slots: torch.Tensor  # [B] int64, where each new token's K/V goes
    # A hybrid model's sliding-window layer groups' (block_tables, slots), group 1
    # first (kvcache/hybrid.py); () for other models.
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def of_group(self, group: int) -> PagedDecode:
        """The inputs a layer of layer group `group` reads and writes by."""
        if not group:
            return self
        tables, slots = self.groups[group - 1]
        return PagedDecode(tables, self.seq_lens, slots)


def widened(block_tables: torch.Tensor) -> torch.Tensor:
    """A table one block wide is given a second column (never read: past seq_len), so
    no graph specialises on a width of one, as Dynamo would for a dimension of 1."""
    if block_tables.shape[1] == 1:
        return torch.cat([block_tables, block_tables], dim=1)
    return block_tables


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D], one query per request at its last position; caches [N, bs, Hkv, D];
    block_tables [B, W] (int); seq_lens [B] (keys 0..len-1 are visible); k_scale,
    v_scale: an fp8 cache's; window, softcap, sinks [Hq]: score_mods.py's. -> [B, Hq, D]."""
    if k_scale is not None:
        return _fp8_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale,
                           v_scale, window, softcap, sinks)
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1]
    # Whole blocks are indexed by the table ([B, W, bs, Hkv, D], fused into the loops
    # below, never stored), and both sums run over (W, bs): Inductor then keeps
    # head_dim innermost and vectorises along it, each vector a contiguous load from
    # one block. Indexing single keys by their slots ([B, W*bs] gathers) made it
    # vectorise the output's sum along the context instead, each lane a gathered load
    # of one value: 4x slower at 16 requests of 160 tokens in float32 (1.66 against
    # 0.41 ms a layer on an AVX2 CPU), 12x in bfloat16.
    bt = block_tables.long()
    k, v = k_cache[bt].float(), v_cache[bt].float()
    qg = q.float().reshape(b, 1, 1, hkv, hq // hkv, d)  # query heads grouped by KV head
    scores = (qg * k.unsqueeze(4)).sum(-1) * scale  # [B, W, bs, Hkv, G]
    scores = score_mods.capped(scores, softcap)
    pos = torch.arange(width * bs, device=q.device).reshape(width, bs)
    lens = seq_lens[:, None, None].long()
    visible = pos[None] < lens
    if window:
        visible = visible & score_mods.in_window(pos[None], lens - 1, window)
    scores = scores.masked_fill(~visible[..., None, None], float("-inf"))
    scores = scores.reshape(b, width * bs, hkv, -1)
    sink = None if sinks is None else sinks.float().reshape(1, hkv, -1).expand(b, -1, -1)
    p = score_mods.softmax(scores, 1, sink).reshape(b, width, bs, hkv, -1, 1)
    out = (p * v.unsqueeze(4)).sum((1, 2))  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


def _fp8_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                k_scale: torch.Tensor, v_scale: torch.Tensor, window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_reference over an fp8 cache. Its keys are indexed one by one in
    any order (softmax and sum do not care), each with its own position for the mask,
    column by column of the block table, so that neighbouring reads are in different
    blocks: Inductor then vectorises the output's sum along head_dim; in block order,
    one-byte values lead its tiling heuristic to vectorise along the context instead,
    each lane a gathered load (3.2x slower). The whole-block form of the other dtypes
    is slower still here (6.7 against 4.4 ms a layer at 16 requests of 160 tokens on
    an AVX2 CPU): e4m3 is widened one value at a time on CPU."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1]
    i = torch.arange(width * bs, device=q.device)
    column, offset = i % width, i // width
    pos = column * bs + offset
    slots = block_tables.long()[:, column] * bs + offset  # [B, L]
    # [B, Hkv, L, D], fused into the loops below, never stored
    k = k_cache.reshape(-1, hkv, d)[slots].float().permute(0, 2, 1, 3)
    v = v_cache.reshape(-1, hkv, d)[slots].float().permute(0, 2, 1, 3)
    qg = q.float().reshape(b, hkv, hq // hkv, 1, d)
    # Context positions last: the softmax reduces along the innermost dimension, so
    # Inductor runs every loop nest in parallel over the requests and heads. With
    # the positions second (scores [B, L, Hkv, G]) it parallelised each softmax
    # reduction on its own, one OpenMP region per request, 1.4-1.5x slower.
    scores = (qg * k.unsqueeze(2)).sum(-1) * scale * k_scale  # [B, Hkv, G, L]
    scores = score_mods.capped(scores, softcap)
    lens = seq_lens[:, None].long()
    visible = pos[None, :] < lens
    if window:
        visible = visible & score_mods.in_window(pos[None, :], lens - 1, window)
    sink = None if sinks is None else sinks.float().reshape(1, hkv, -1).expand(b, -1, -1)
    p = score_mods.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")),
                           -1, sink)
    out = (p.unsqueeze(-1) * v.unsqueeze(2)).sum(3) * v_scale  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """K/V rows [T, Hkv, D] into their cache slots, with plain ops (eagerly in the
    torch backend, traced into the decode graphs)."""
    store_rows(k, k_cache, slots, k_scale)
    store_rows(v, v_cache, slots, v_scale)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           window: int = 0, softcap: float = 0.0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_reference's result: through kvserve's CPU kernel (the op
    kvserve::paged_decode, engine/kernels/cpu/paged_decode.cpp) for plain attention
    over float32 and bf16 caches where this process has the kernels, 1.8-4x faster;
    else the reference's ops, compiled by the caller."""
    if kernel_reads(q, k_cache, k_scale) and score_mods.plain(window, softcap, sinks):
        return torch.ops.kvserve.paged_decode(q, k_cache, v_cache, block_tables.int(),
                                              seq_lens.int(), scale)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                  k_scale, v_scale, window, softcap, sinks)


def kernel_reads(q: torch.Tensor, k_cache: torch.Tensor, k_scale) -> bool:
    """Whether kvserve's attention kernels (paged_decode, paged_prefill) read this cache:
    loaded in this process, a float32 or bf16 CPU cache of q's dtype, heads of 8k."""
    return (cpu_kernels.loaded() and k_scale is None and q.device.type == "cpu"
            and q.dtype == k_cache.dtype and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] % 8 == 0)


def decode_in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, step: PagedDecode,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Stores the step's K/V [B, Hkv, D] at step.slots, then attends: what the attention
    custom op does for decodes, as ops a compiled graph can take in (Inductor writes
    the store into the cache in place)."""
    store_kv(k, v, k_cache, v_cache, step.slots, k_scale, v_scale)
    return attend(q, k_cache, v_cache, step.block_tables, step.seq_lens, scale, k_scale,
                  v_scale, window, softcap, sinks)


_compiled = None


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """attend: the kernel, else the reference compiled (once, for every batch size
    and length, and once per window, cap and sinks a model's layers have)."""
    global _compiled
    if kernel_reads(q, k_cache, k_scale) and score_mods.plain(window, softcap, sinks):
        return attend(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if _compiled is None:
        _compiled = torch.compile(paged_decode_reference, fullgraph=True)
    block_tables = widened(block_tables)
    # Fresh views: the caches themselves are inputs of the model's compiled graphs,
    # which mark them static, and a static input is guarded on its identity (a
    # recompilation per layer). Always below autograd's view tracking, as inside a
    # compiled graph: the guards check the thread's dispatch state too, and a call
    # from eager code would otherwise be a recompilation.
    with torch.inference_mode(), torch._C._AutoDispatchBelowADInplaceOrView():
        k_view, v_view = k_cache.view(k_cache.shape), v_cache.view(v_cache.shape)
        # Batch size and table width vary (a batch of one has a graph of its own),
        # and so does the cache's block count from one engine to the next: the
        # graphs are shared by every engine of the process (Dynamo's limit of 8
        # per function would otherwise be reached by a process holding several).
        for t, dims in ((q, (0,)), (block_tables, (0, 1)), (seq_lens, (0,)),
                        (k_view, (0,)), (v_view, (0,))):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(t, dim)
        return _compiled(q, k_view, v_view, block_tables, seq_lens, scale, k_scale, v_scale,
                         window, softcap, sinks)
