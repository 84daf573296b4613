"""Reference attention over a paged KV cache with torch ops only: runs anywhere and
is the oracle for faster backends.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads,
head_dim]; flattened over the first two dims a token's K/V lives at its "slot"
(block_id * block_size + offset). `prepare` turns the common metadata into gather
indices and masks once per step; every layer then gathers its context with them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kvserve.engine.kernels.attention import score_mods
from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.context import AttentionMetadata
from kvserve.engine.kernels.attention.latent import LatentShape
from kvserve.engine.kernels.attention.cpu_paged import (PagedDecode, kernel_reads, paged_decode,
                                                        store_kv, widened)
from kvserve.engine.kernels.attention.step_metadata import context_slots
from kvserve.engine.kernels.fp8_cache import read_rows


@dataclass
class PrefillSpan:
    """A request computing more than one token this step (a prompt or a chunk of it)."""

    query_start: int  # first row of this request in the flat batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] cache slots of the whole context, in order
    mask: torch.Tensor | None  # [query_len, context_len] bool, None when plain causal
    # In place (kvserve::paged_prefill reads the cache where it lies): the request's
    # block table row [max_blocks] int32 and its context's length; else None.
    block_table: torch.Tensor | None = None
    context_len: int = 0

    def windowed(self, window: int) -> PrefillSpan:
        """This span's mask narrowed to a sliding window."""
        dev = self.context_slots.device
        key_pos = torch.arange(self.context_len, device=dev)
        q_pos = torch.arange(self.context_len - self.query_len, self.context_len,
                             device=dev).unsqueeze(1)
        mask = (key_pos <= q_pos) & score_mods.in_window(key_pos, q_pos, window)
        return replace(self, mask=mask)


@dataclass
class TorchAttentionMetadata:
    store_rows: torch.Tensor  # rows of the batch whose K/V are stored (slot != -1)
    store_slots: torch.Tensor  # their slots
    prefills: list[PrefillSpan]
    # The decodes (rows 0..B-1) in one padded call: [B, max_context] slots padded
    # with 0, and [B, 1, 1, max_context] True where a real key is.
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    # Short queries (speculative verifications, tiny prompts) in one padded call too:
    # [S, Q] batch rows (a short request's padding repeats its last row), [S, L]
    # context slots, [S, 1, Q, L] causal mask. None when there are none.
    short: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # With paged decode, the decodes read the cache in place instead (decode_slots
    # and decode_mask None); `paged.slots` are those of the decodes only.
    paged: PagedDecode | None = None
    # The query positions of the decodes' [B, 1, 1, 1] and of the short rows'
    # [S, 1, Q, 1] masks, to narrow them to a window (`windowed`).
    decode_query_pos: torch.Tensor | None = None
    short_query_pos: torch.Tensor | None = None
    _windowed: dict[int, TorchAttentionMetadata] = field(default_factory=dict)

    def windowed(self, window: int) -> TorchAttentionMetadata:
        """The step's metadata with every mask narrowed to a sliding window (made
        once a step for each window the model's layers have)."""
        if not window:
            return self
        if window not in self._windowed:
            short, decode_mask = self.short, self.decode_mask
            if short is not None:
                rows, slots, mask = short
                key_pos = torch.arange(mask.shape[-1], device=mask.device)
                short = (rows, slots, mask & score_mods.in_window(
                    key_pos, self.short_query_pos, window))
            if decode_mask is not None:
                key_pos = torch.arange(decode_mask.shape[-1], device=decode_mask.device)
                decode_mask = decode_mask & score_mods.in_window(
                    key_pos, self.decode_query_pos, window)
            self._windowed[window] = replace(
                self, prefills=[s.windowed(window) for s in self.prefills],
                decode_mask=decode_mask, short=short, _windowed={})
        return self._windowed[window]

    def decode_only(self) -> PagedDecode | None:
        """The step's attention inputs for a compiled decode graph, if every row
        of the step is a paged decode."""
        if self.paged is None or self.prefills or self.short is not None:
            return None
        return self.paged if len(self.paged.slots) == len(self.store_slots) else None


# A request computing at most this many tokens joins the padded batched call instead
# of an attention call of its own: one call per verification would cost more than
# the whole step saves on CPU.
SHORT_QUERY = 16


class TorchBackend(AttentionBackend):
    """in_place: K/V read where they lie in the cache instead of gathered out of it for
    each context: decodes through cpu_paged.py (kvserve's kernel or Inductor's loops),
    prompt chunks through kvserve::paged_prefill where the kernels are loaded and read
    the cache's dtype (engine/kernels/cpu/paged_prefill.cpp, up to 2x faster than the
    gather and SDPA); the rest stays the reference."""
    name = "torch"
    traces_paged_decode = True

    def __init__(self, in_place: bool = False):
        self.in_place = in_place

    def in_place_reader(self) -> TorchBackend:
        return self if self.in_place else TorchBackend(in_place=True)

    def traced_decode(self, meta: TorchAttentionMetadata) -> PagedDecode | None:
        return meta.decode_only()

    def prepare(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        rows = torch.nonzero(common.slot_mapping >= 0).squeeze(1)
        slots, mask, paged, decode_pos = None, None, None, None
        nd = common.num_decodes
        in_place = self.in_place
        if nd and in_place:
            paged = PagedDecode(widened(common.block_tables[:nd]), common.seq_lens[:nd],
                                common.slot_mapping[:nd])
        elif nd:
            slots, mask = self._decodes(common)
            decode_pos = (common.seq_lens[:nd].long() - 1)[:, None, None, None]
        lens = common.query_start_loc_cpu.diff().tolist()
        short = [i for i in range(common.num_decodes, common.num_reqs)
                 if lens[i] <= SHORT_QUERY]
        long = [i for i in range(common.num_decodes, common.num_reqs) if lens[i] > SHORT_QUERY]
        shorts = self._shorts(common, short) if short else None
        return TorchAttentionMetadata(rows, common.slot_mapping[rows],
                                      self._prefills(common, long, in_place), slots, mask,
                                      shorts[:3] if shorts else None, paged, decode_pos,
                                      shorts[3] if shorts else None)

    @staticmethod
    def _decodes(c: AttentionMetadata):
        nd = c.num_decodes
        max_ctx = int(c.seq_lens_cpu[:nd].max())
        key_pos = torch.arange(max_ctx, device=c.seq_lens.device).expand(nd, max_ctx)
        seq_lens = c.seq_lens[:nd].unsqueeze(1).long()
        # Padding repeats the last real key (masked out): it never reads a slot the
        # request does not own.
        slots = context_slots(c.block_tables[:nd], key_pos.minimum(seq_lens - 1), c.block_size)
        return slots, (key_pos < seq_lens)[:, None, None, :]

    @staticmethod
    def _shorts(c: AttentionMetadata, idx: list[int]):
        dev = c.seq_lens.device
        index = torch.tensor(idx)
        first = c.query_start_loc_cpu[index].long()
        q_len = c.query_start_loc_cpu[index + 1].long() - first
        ctx = c.seq_lens_cpu[index].long()
        j = torch.arange(int(q_len.max())).expand(len(idx), -1).minimum(q_len[:, None] - 1)
        rows = first[:, None] + j  # [S, Q]
        q_pos = (ctx - q_len)[:, None] + j  # the position each row queries from
        key_pos = torch.arange(int(ctx.max())).expand(len(idx), -1)
        # Padding repeats the last real key (masked out), as for decodes.
        slots = context_slots(c.block_tables[index.to(dev)],
                              key_pos.minimum(ctx[:, None] - 1).to(dev), c.block_size)
        mask = key_pos[:, None, :] <= q_pos[:, :, None]  # causal; < ctx follows
        return rows.to(dev), slots, mask[:, None].to(dev), q_pos[:, None, :, None].to(dev)

    @staticmethod
    def _prefills(c: AttentionMetadata, idx: list[int], in_place: bool) -> list[PrefillSpan]:
        spans = []
        starts, seq_lens = c.query_start_loc_cpu.tolist(), c.seq_lens_cpu.tolist()
        dev = c.seq_lens.device
        for i in idx:
            q_len, ctx_len = starts[i + 1] - starts[i], seq_lens[i]
            key_pos = torch.arange(ctx_len, device=dev)
            slots = context_slots(c.block_tables[i], key_pos, c.block_size)
            mask = None
            if ctx_len > q_len:  # a cached prefix: causal with an offset
                q_pos = torch.arange(ctx_len - q_len, ctx_len, device=dev).unsqueeze(1)
                mask = key_pos.unsqueeze(0) <= q_pos
            spans.append(PrefillSpan(starts[i], q_len, slots, mask,
                                     c.block_tables[i] if in_place else None, ctx_len))
        return spans

    def latent_attention(self, q, q_nope, entry, cache, meta: TorchAttentionMetadata, scale,
                         kv_b, nope):
        """kvserve::latent_attention (latent.py): prompt chunks long enough expanded,
        every other row absorbed."""
        shape = LatentShape.of(q, kv_b, nope)
        chosen = shape.expanded([s.query_len for s in meta.prefills],
                                [s.context_len for s in meta.prefills], q.element_size())
        long = [s for s, expand in zip(meta.prefills, chosen) if expand]
        rest = replace(meta, prefills=[s for s, expand in zip(meta.prefills, chosen)
                                       if not expand], _windowed={}) if long else meta
        absorbed = self.forward(q, entry, entry, cache, cache, rest, scale)  # stores all
        expanded = q.new_zeros(q.shape[0], shape.heads, shape.v)
        for span in long:
            rows = slice(span.query_start, span.query_start + span.query_len)
            absorbed[rows] = 0
            expanded[rows] = _expanded_prefill(q[rows], q_nope[rows], cache, span, scale,
                                               kv_b, nope)
        return absorbed, expanded

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttentionMetadata, scale,
                k_scale=None, v_scale=None, window=0, softcap=0.0, sinks=None):
        store_kv(k[meta.store_rows], v[meta.store_rows], k_cache, v_cache, meta.store_slots,
                 k_scale, v_scale)
        kv_heads, head_dim = k_cache.shape[-2:]
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)

        def context(slots):  # the K and V at these slots, in q's dtype
            return (read_rows(k_flat[slots], k_scale, q.dtype),
                    read_rows(v_flat[slots], v_scale, q.dtype))

        kernel = kernel_reads(q, k_cache, k_scale) and score_mods.plain(window, softcap, sinks)
        mods = (scale, softcap, sinks)
        meta = meta.windowed(window)
        out = torch.empty_like(q)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            if span.block_table is not None and kernel:
                out[rows] = torch.ops.kvserve.paged_prefill(
                    q[rows], k_cache, v_cache, span.block_table, span.context_len, scale)
            else:
                out[rows] = _prefill(q[rows], *context(span.context_slots), span.mask, *mods)
        if meta.paged is not None:
            nd = meta.paged.block_tables.shape[0]
            out[:nd] = paged_decode(q[:nd], k_cache, v_cache, meta.paged.block_tables,
                                    meta.paged.seq_lens, scale, k_scale, v_scale, window,
                                    softcap, sinks)
        if meta.decode_slots is not None:
            nd = meta.decode_slots.shape[0]
            out[:nd] = _decode(q[:nd], *context(meta.decode_slots), meta.decode_mask, *mods)
        if meta.short is not None:
            rows, slots, mask = meta.short
            # A padded row repeats its request's last row and mask, so writing every
            # row back writes identical values twice, never a wrong one.
            o = _short(q[rows], *context(slots), mask, *mods)
            out[rows.reshape(-1)] = o.reshape(-1, *o.shape[2:])
        return out


def _expanded_prefill(q, q_nope, cache, span: PrefillSpan, scale, kv_b, nope):
    """One prompt chunk of latent attention expanded (latent.py): each head's keys
    [W_UK c, k_rot] and values W_UV c made from the context's latents, then plain
    attention. q [Q, H, latent + rotary] (its rotary part read), q_nope [Q, H, nope];
    -> [Q, H, v]."""
    heads, latent = q.shape[1], kv_b.shape[1]
    rows = cache.view(-1, cache.shape[-1])[span.context_slots].to(q.dtype)  # [C, L + R]
    kv = torch.einsum("cl,hdl->hcd", rows[:, :latent], kv_b.view(heads, -1, latent))
    rot = rows[:, latent:]
    k = torch.cat((kv[..., :nope], rot.expand(heads, *rot.shape)), dim=-1)
    query = torch.cat((q_nope, q[..., latent:]), dim=-1).transpose(0, 1)  # [H, Q, nope + R]
    values = kv[..., nope:]
    v_dim, qk_dim = values.shape[-1], k.shape[-1]
    if v_dim < qk_dim:  # SDPA's fused CPU kernels want one head width (4x faster)
        values = F.pad(values, (0, qk_dim - v_dim))
    o = _attend(query[None], k[None], values[None], span.mask, scale, 0.0, None)
    return o[0, ..., :v_dim].transpose(0, 1)


def _attend(q, k, v, mask, scale, softcap, sinks):
    """q [B, H, Q, D]; k, v [B, Hkv, L, D]; mask: bool [.., Q, L], None for plain
    causal. SDPA, or written out where it cannot (soft-capping, sinks)."""
    if softcap or sinks is not None:
        if mask is None:
            qn, ln = q.shape[2], k.shape[2]
            mask = torch.ones(qn, ln, dtype=torch.bool, device=q.device).tril(ln - qn)
        return score_mods.attend_dense(q, k, v, mask, scale, softcap, sinks).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _prefill(q, k, v, mask, scale, softcap=0.0, sinks=None):
    # [L, H, D] -> [1, H, L, D]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return _attend(q, k, v, mask, scale, softcap, sinks).squeeze(0).transpose(0, 1)


def _short(q, k, v, mask, scale, softcap=0.0, sinks=None):
    # q: [S, Q, H, D] -> [S, H, Q, D]; k, v: [S, L, Hkv, D] -> [S, Hkv, L, D]
    o = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale,
                softcap, sinks)
    return o.transpose(1, 2)  # [S, Q, H, D]


def _decode(q, k, v, mask, scale, softcap=0.0, sinks=None):
    # q: [B, H, D] -> [B, H, 1, D]; k, v: [B, L, Hkv, D] -> [B, Hkv, L, D]
    o = _attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask, scale,
                softcap, sinks)
    return o.squeeze(2)
