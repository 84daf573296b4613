"""Sliding windows, logit soft-capping and attention sinks in every attention path
(engine/kernels/attention/score_mods.py): the torch backend (gathered and in-place
decodes, short queries, prompt spans with and without a cached prefix) and the
Triton kernels, each against attention written out per query row here."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.engine.kernels.attention.torch_backend import TorchBackend
from kvserve.engine.kernels.attention.triton_backend import TritonBackend
from tests.engine.attention.paged_batch import PagedBatch, make_batch, needs_kernel_device
from tests.engine.attention.tolerances import assert_close

# 3 decodes, a short query (a verification), a chunk after a cached prefix, and a
# fresh prompt: every context longer than the window.
Q_LENS = [1, 1, 1, 4, 40, 70]
SEQ_LENS = [30, 100, 61, 50, 90, 70]
MODS = {
    "window": dict(window=24),
    "softcap": dict(softcap=5.0),
    "sinks": dict(sinks=True),
    "all": dict(window=17, softcap=8.0, sinks=True),
}


def expected(b: PagedBatch, window=0, softcap=0.0, sinks=None) -> torch.Tensor:
    """One query row at a time, in float64: scores, cap, window, sink, softmax."""
    kc, vc = b.k_cache.double().clone(), b.v_cache.double().clone()
    hd = kc.shape[-2:]
    kc.view(-1, *hd)[b.meta.slot_mapping] = b.k.double()
    vc.view(-1, *hd)[b.meta.slot_mapping] = b.v.double()
    out = torch.empty(b.q.shape, dtype=torch.float64)
    starts = b.meta.query_start_loc_cpu.tolist()
    group = b.q.shape[1] // hd[0]
    for r, seq_len in enumerate(b.meta.seq_lens_cpu.tolist()):
        bs = kc.shape[1]
        table = b.meta.block_tables[r].long()
        slots = table[torch.arange(seq_len) // bs] * bs + torch.arange(seq_len) % bs
        k, v = kc.view(-1, *hd)[slots], vc.view(-1, *hd)[slots]  # [L, Hkv, D]
        for row in range(starts[r], starts[r + 1]):
            pos = seq_len - (starts[r + 1] - row)
            first = max(0, pos - window + 1) if window else 0
            for h in range(b.q.shape[1]):
                s = k[first:pos + 1, h // group] @ b.q[row, h].double() * b.scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                logits = s if sinks is None else torch.cat([s, sinks[h:h + 1].double()])
                p = torch.softmax(logits, 0)[:len(s)]
                out[row, h] = p @ v[first:pos + 1, h // group]
    return out


def batch_and_mods(name: str, dtype=torch.float32, poison: float = float("nan"),
                   device: str | None = None):
    """poison: what fills the cache's slots no request owns (the in-place decode
    reads whole blocks, its last one's free slots too, weighted by 0: not NaN)."""
    b = make_batch(Q_LENS, SEQ_LENS, 6, 2, 32, 16, dtype, seed=len(name), poison=poison,
                   **({"device": device} if device else {}))
    mods = dict(MODS[name])
    if mods.pop("sinks", False):
        mods["sinks"] = torch.randn(6, generator=torch.Generator().manual_seed(1)) + 2.0
    return b, mods


def run(backend, b: PagedBatch, mods: dict) -> torch.Tensor:
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    sinks = mods.get("sinks")
    args = dict(mods, sinks=None if sinks is None else sinks.to(b.q.device))
    return backend.forward(b.q, b.k, b.v, k_cache, v_cache, backend.prepare(b.meta), b.scale,
                           **args)


@pytest.mark.parametrize("in_place", [False, True], ids=["gathered", "in-place"])
@pytest.mark.parametrize("name", MODS)
def test_torch_backend(name, in_place):
    b, mods = batch_and_mods(name, poison=0.0 if in_place else float("nan"), device="cpu")
    got = run(TorchBackend(in_place=in_place), b, mods)
    torch.testing.assert_close(got.double(), expected(b, **mods), rtol=1e-4, atol=1e-4)


@needs_kernel_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MODS)
def test_triton_kernels(name, dtype):
    b, mods = batch_and_mods(name, dtype)
    got = run(TritonBackend(), b, mods)
    # The same batch (same seed) built on the CPU, upcast: the reference's metadata
    # must live where its tensors do.
    c, _ = batch_and_mods(name, dtype, device="cpu")
    want = run(TorchBackend(), PagedBatch(
        c.q.float(), c.k.float(), c.v.float(), c.k_cache.float(), c.v_cache.float(), c.meta,
        c.scale), mods)
    assert_close(got.cpu(), want.to(dtype))


def test_softcap_of_exp2_scores_is_tanh():
    """The Triton kernels' tanh from exp2, against torch's, on the interpreter."""
    from kvserve.engine.kernels.attention.triton.common import LOG2E

    s = torch.linspace(-200, 200, 4001, dtype=torch.float64)
    cap = 30.0
    t = torch.exp(-2 * (s / cap).abs())
    ours = torch.where(s < 0, -1, 1) * (1 - t) / (1 + t) * cap
    torch.testing.assert_close(ours, cap * torch.tanh(s / cap))
    assert math.isclose(LOG2E, 1 / math.log(2))
