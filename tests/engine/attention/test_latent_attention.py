"""Latent attention (engine/kernels/attention/latent.py): long prompt chunks expanded
per head equal the absorbed form on the same step (decodes, fresh prompts, chunks
after a cached prefix, short chunks between long ones), on the torch reference and
the Triton backend, and only chunks past the break-even length, within the scratch
budget, are expanded."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention import clear_attention_context, set_attention_context
from kvserve.engine.kernels.attention import latent
from kvserve.engine.kernels.attention.latent import LatentShape, expands, latent_attention
from kvserve.engine.kernels.attention.step_metadata import build_host_step
from kvserve.engine.kernels.attention.torch_backend import TorchBackend
from kvserve.engine.kernels.attention.triton_backend import TritonBackend, _runs
from tests.engine.attention.paged_batch import DEVICE, needs_kernel_device
from tests.engine.attention.tolerances import assert_close

HEADS, LATENT, ROTARY, NOPE, V = 4, 32, 8, 16, 16
BS = 16
SHAPE = LatentShape(HEADS, LATENT, ROTARY, NOPE, V)


def test_the_break_even_length():
    assert not expands(32, LATENT, ROTARY, NOPE, V) and expands(33, LATENT, ROTARY, NOPE, V)
    assert not expands(170, 512, 64, 128, 128) and expands(171, 512, 64, 128, 128)


def test_the_scratch_budget_absorbs_what_does_not_fit(monkeypatch):
    # Chunks 2 and 3 are long enough; only one context's scratch fits the budget.
    monkeypatch.setattr(latent, "EXPANSION_WORKSPACE_BYTES",
                        SHAPE.workspace_bytes(500, 4) + 1)
    assert SHAPE.expanded([10, 40, 40, 40], [10, 400, 500, 40], 4) == [
        False, True, False, True]


def test_runs_group_consecutive_requests_alike():
    assert _runs(2, [5, 40, 50, 3, 60], [False, True, True, False, True]) == [
        ((2, 1, 5), False), ((3, 2, 50), True), ((5, 1, 3), False), ((6, 1, 60), True)]


def _tables(starts, lens) -> list[list[int]]:
    tables, next_block = [], 0
    for start, n in zip(starts, lens):
        blocks = -(-(start + n) // BS)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    return tables


def _fill_prefixes(cache, tables, starts, g) -> None:
    """Each request's cache rows before its start, random."""
    flat = cache.view(-1, cache.shape[-1])
    for table, start in zip(tables, starts):
        for pos in range(start):
            flat[table[pos // BS] * BS + pos % BS] = torch.randn(
                cache.shape[-1], generator=g, dtype=torch.float64)


def _meta(backend, starts, lens, tables, device):
    _, common, _ = build_host_step(starts, lens, tables, BS).to_device(torch.device(device))
    return backend.prepare(common)


BACKENDS = [pytest.param(TorchBackend, torch.float64, "cpu", id="torch"),
            pytest.param(TritonBackend, torch.float32, DEVICE, id="triton",
                         marks=needs_kernel_device)]


@pytest.mark.parametrize("make_backend,dtype,device", BACKENDS)
def test_expanded_chunks_equal_the_absorbed_form(make_backend, dtype, device):
    g = torch.Generator().manual_seed(0)
    backend = make_backend()
    # Two decodes, then a fresh prompt, a short chunk after a prefix (absorbed), a
    # chunk after a prefix, and a short fresh prompt: expanded, absorbed, expanded,
    # absorbed runs.
    starts, lens = [40, 3, 0, 20, 24, 0], [1, 1, 50, 5, 45, 9]
    tokens = sum(lens)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    kv_b = rand(HEADS * (NOPE + V), LATENT) * 0.3
    w_uk, w_uv = kv_b.view(HEADS, NOPE + V, LATENT).split([NOPE, V], dim=1)
    q_nope, q_rot = rand(tokens, HEADS, NOPE), rand(tokens, HEADS, ROTARY)
    q = torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_rot), dim=-1)
    entry = rand(tokens, 1, LATENT + ROTARY)
    cache = torch.full((24, BS, 1, LATENT + ROTARY), float("nan"), dtype=torch.float64)
    tables = _tables(starts, lens)
    _fill_prefixes(cache, tables, starts, g)
    reference = TorchBackend()
    ref_meta = _meta(reference, starts, lens, tables, "cpu")
    stored = cache.clone()  # the reference's store: every row's entry at its slot
    want = reference.forward(q, entry, entry, stored, stored, ref_meta, 0.2)
    want = torch.einsum("thl,hvl->thv", want[..., :LATENT], w_uv)

    def on(t):
        return t.to(device=device, dtype=dtype)

    got_cache = on(cache)
    meta = _meta(backend, starts, lens, tables, device)
    set_attention_context(backend, meta)
    try:
        o, expanded = latent_attention(on(q), on(q_nope), on(entry), got_cache, on(kv_b),
                                       0.2, NOPE)
    finally:
        clear_attention_context()
    got = torch.einsum("thl,hvl->thv", o[..., :LATENT], on(w_uv)) + expanded
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    else:
        assert_close(got, want)
    torch.testing.assert_close(got_cache.cpu(), stored.to(dtype), equal_nan=True, atol=0,
                               rtol=0)  # every row's entry stored, nothing else
    rows = torch.tensor(lens).repeat_interleave(torch.tensor(lens))  # each row's chunk
    long = rows > 32
    o = o[..., :LATENT]  # (the rotary part: attention over k_rot, unused, unspecified)
    assert not expanded[~long].any() and o[~long].abs().sum(-1).gt(0).all()
    assert expanded[long].abs().sum(-1).gt(0).all() and not o[long].any()
