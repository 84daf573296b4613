"""Latent attention (engine/kernels/attention/latent.py): long prompt chunks expanded
per head equal the absorbed form on the same step (a decode, a fresh prompt, a chunk
after a cached prefix), and only chunks past the break-even length are expanded."""
from __future__ import annotations

import torch

from kvserve.engine.kernels.attention import clear_attention_context, set_attention_context
from kvserve.engine.kernels.attention.latent import expands, latent_attention
from kvserve.engine.kernels.attention.step_metadata import build_host_step
from kvserve.engine.kernels.attention.torch_backend import TorchBackend

HEADS, LATENT, ROTARY, NOPE, V = 4, 32, 8, 16, 16
BS = 16


def test_the_break_even_length():
    assert not expands(32, LATENT, ROTARY, NOPE, V) and expands(33, LATENT, ROTARY, NOPE, V)
    assert not expands(170, 512, 64, 128, 128) and expands(171, 512, 64, 128, 128)


def _step(backend, starts, lens, cache, g):
    """Each request's cache rows before `starts` filled; the step's tensors."""
    tables, next_block = [], 0
    for start, n in zip(starts, lens):
        blocks = -(-(start + n) // BS)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    flat = cache.view(-1, cache.shape[-1])
    for table, start in zip(tables, starts):
        for pos in range(start):
            flat[table[pos // BS] * BS + pos % BS] = torch.randn(cache.shape[-1], generator=g,
                                                                 dtype=torch.float64)
    host = build_host_step(starts, lens, tables, BS)
    _, common, _ = host.to_device(torch.device("cpu"))
    return backend.prepare(common)


def test_expanded_chunks_equal_the_absorbed_form():
    g = torch.Generator().manual_seed(0)
    backend = TorchBackend()
    starts, lens = [40, 0, 24], [1, 50, 45]  # a decode, a fresh prompt, after a prefix
    tokens = sum(lens)
    kv_b = torch.randn(HEADS * (NOPE + V), LATENT, generator=g, dtype=torch.float64) * 0.3
    w_uk, w_uv = kv_b.view(HEADS, NOPE + V, LATENT).split([NOPE, V], dim=1)
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=g, dtype=torch.float64)
    q_rot = torch.randn(tokens, HEADS, ROTARY, generator=g, dtype=torch.float64)
    q = torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_rot), dim=-1)
    entry = torch.randn(tokens, 1, LATENT + ROTARY, generator=g, dtype=torch.float64)
    cache = torch.zeros(16, BS, 1, LATENT + ROTARY, dtype=torch.float64)
    meta = _step(backend, starts, lens, cache, g)
    absorbed_cache = cache.clone()
    set_attention_context(backend, meta)
    try:
        o, expanded = latent_attention(q, q_nope, entry, cache, kv_b, 0.2, NOPE)
    finally:
        clear_attention_context()
    got = torch.einsum("thl,hvl->thv", o[..., :LATENT], w_uv) + expanded
    want = backend.forward(q, entry, entry, absorbed_cache, absorbed_cache, meta, 0.2)
    want = torch.einsum("thl,hvl->thv", want[..., :LATENT], w_uv)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cache, absorbed_cache)  # every row's entry stored
    assert not expanded[0].any() and o[0].any()  # the decode absorbed
    assert expanded[1:].abs().sum(-1).gt(0).all()  # both chunks (50, 45 > 32) expanded
    assert not o[1:].any()
