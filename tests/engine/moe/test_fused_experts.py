"""The routed experts: the CPU op (kvserve::fused_experts) against experts looped
token by token, and the Triton grouped GEMMs (interpreted on CPU) against the CPU
op, including gpt-oss's biases and clamped SwiGLU, expert parallelism (pairs of
another rank's experts left out), and the padding of each expert's run."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.kernels.moe.fused_experts import fused_experts, gated
from kvserve.engine.kernels.moe.triton_experts import BLOCK_M, align, triton_fused_experts

# Interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 unless told
# otherwise); with TRITON_INTERPRET=0 on a GPU host the same tests run on the GPU.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
interpreted = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="Triton kernels need TRITON_INTERPRET=1 or CUDA")


def on_device(args):
    return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]


def case(tokens=7, experts=6, top_k=2, hidden=40, inter=24, bias=False, seed=0,
         dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x = randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).to(dtype)
    w13, w2 = randn(experts, 2 * inter, hidden) * 0.2, randn(experts, hidden, inter) * 0.2
    biases = (randn(experts, 2 * inter), randn(experts, hidden)) if bias else (None, None)
    return x, ids, weights, w13, w2, *biases


def loop(x, ids, weights, w13, w2, b13, b2, first=0, activation=("silu", 0.0, 0.0)):
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - first
            if not 0 <= e < w13.shape[0]:
                continue
            h = F.linear(x[t].double(), w13[e].double(),
                         None if b13 is None else b13[e].double())
            y = F.linear(gated(h, *activation), w2[e].double(),
                         None if b2 is None else b2[e].double())
            out[t] += weights[t, k].double() * y
    return out


@pytest.mark.parametrize("bias,activation", [(False, ("silu", 0.0, 0.0)),
                                             (True, ("swiglu_oai", 1.5, 1.702))])
def test_cpu_op_equals_a_loop_over_tokens(bias, activation):
    args = case(bias=bias)
    got = fused_experts(*args[:5], 0, *args[5:], *activation)
    torch.testing.assert_close(got.double(), loop(*args, activation=activation),
                               rtol=1e-5, atol=1e-5)


def test_expert_parallel_ranks_sum_to_the_whole():
    x, ids, weights, w13, w2, _, _ = case(experts=8, tokens=9, top_k=3)
    whole = fused_experts(x, ids, weights, w13, w2, 0)
    halves = sum(fused_experts(x, ids, weights, w13[r * 4:(r + 1) * 4],
                               w2[r * 4:(r + 1) * 4], r * 4) for r in range(2))
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-5)


def test_align_groups_pairs_by_expert_in_padded_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])  # expert 5 on another rank
    pairs, block_expert = align(ids, 4, 0, 4)
    n = ids.numel()
    blocks = pairs.view(-1, 4)
    seen = []
    for block, expert in zip(blocks.tolist(), block_expert.tolist()):
        real = [p for p in block if p < n]
        if expert >= 4:
            assert not real
            continue
        assert all(ids.view(-1)[p] == expert for p in real)
        seen += real
    assert sorted(seen) == [p for p in range(n) if ids.view(-1)[p] < 4]
    assert len(pairs) % 4 == 0 and len(pairs) >= n + 4 * 3


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,bias", [(1, False), (37, False), (5, True)])
def test_triton_kernels_equal_the_cpu_op(tokens, bias, dtype):
    activation = ("swiglu_oai", 2.0, 1.702) if bias else ("silu", 0.0, 0.0)
    args = case(tokens=tokens, experts=5, top_k=2, hidden=72, inter=40, bias=bias, seed=tokens,
                dtype=dtype)
    want = fused_experts(*[a.float() if a is not None and a.is_floating_point() else a
                           for a in args[:5]], 0,
                         *[None if a is None else a.float() for a in args[5:]], *activation)
    dev = on_device(args)
    got = triton_fused_experts(*dev[:5], 0, *dev[5:], *activation).cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@interpreted
def test_triton_kernels_leave_other_ranks_experts_out():
    x, ids, weights, w13, w2, _, _ = case(experts=8, tokens=6, top_k=3, seed=3)
    want = fused_experts(x, ids, weights, w13[4:], w2[4:], 4)
    got = triton_fused_experts(*on_device([x, ids, weights, w13[4:], w2[4:]]), 4).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert BLOCK_M >= 16  # tl.dot's smallest tile on the GPU


def _quantized(w: torch.Tensor, kind: str, g: torch.Generator, group: int):
    """(stored weight, scale, minimum) of `kind`: int8 rows (a scale per row), int8
    values in groups with scales, or 4-bit code pairs in groups with scales and
    minimums (a GGUF's kept experts, --quantization int4)."""
    from kvserve.engine.models.quantized.int8 import quantize_int8

    e, n, k = w.shape
    if kind == "rows":
        q, scale = quantize_int8(w.reshape(-1, k), torch.float32)
        return q.view(e, n, k), scale.view(e, n), None
    scale = torch.rand(e, n, k // group, generator=g) * 0.01 + 0.002
    if kind == "groups":
        return torch.randint(-127, 128, (e, n, k), generator=g, dtype=torch.int8), scale, None
    low = -torch.rand(e, n, k // group, generator=g) * 0.2
    return torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8), scale, low


@interpreted
@pytest.mark.parametrize("kind, group", [("rows", 0), ("groups", 8), ("nibbles", 8),
                                         ("nibbles", 32)])
@pytest.mark.parametrize("tokens", [1, 21])
def test_triton_kernels_read_quantized_experts_as_the_cpu_op(kind, group, tokens):
    """int8 experts with a scale a row (--quantization int8), a GGUF's int8 groups,
    and 4-bit code pairs with minimums (a GGUF's K-quants, --quantization int4),
    widened tile by tile in the kernels, equal to the CPU op on the same values.
    Groups narrower than a tile's inputs take a factor per element; a group of 32
    (a tile's) a factor per row."""
    g = torch.Generator().manual_seed(tokens)
    x, ids, weights, w13, w2, b13, b2 = case(tokens=tokens, experts=5, top_k=2, hidden=64,
                                             inter=48 if group != 32 else 64, bias=True,
                                             seed=tokens)
    q13, s13, m13 = _quantized(w13, kind, g, group)
    q2, s2, m2 = _quantized(w2, kind, g, group)
    activation = ("swiglu_oai", 2.0, 1.702)
    want = fused_experts(x, ids, weights, q13, q2, 0, b13, b2, *activation, s13, s2, m13, m2)
    dev = on_device([x, ids, weights, q13, q2, b13, b2, s13, m13, s2, m2])
    got = triton_fused_experts(*dev[:5], 0, *dev[5:7], *activation, tuple(dev[7:9]),
                               tuple(dev[9:])).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_per_expert_loop_equals_the_grouped_gemms(monkeypatch):
    """Where torch has no _grouped_mm the op loops over the active experts."""
    from kvserve.engine.kernels.moe import fused_experts as module

    args = case(bias=True, experts=8, tokens=11, top_k=3)
    activation = ("swiglu_oai", 1.5, 1.702)
    grouped = fused_experts(*args[:5], 4, *args[5:], *activation)  # half on this rank
    monkeypatch.setattr(module, "GROUPED", False)
    looped = fused_experts(*args[:5], 4, *args[5:], *activation)
    torch.testing.assert_close(looped, grouped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped.double(), loop(*args, first=4, activation=activation),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias,activation", [(False, ("silu", 0.0, 0.0)),
                                             (True, ("swiglu_oai", 1.5, 1.702))])
def test_one_token_form_equals_the_op(bias, activation):
    """The plain-ops form a batch-1 decode graph traces, compiled as it would be,
    including experts held by another rank."""
    from kvserve.engine.kernels.moe.fused_experts import one_token_experts

    x, ids, weights, w13, w2, b13, b2 = case(tokens=1, experts=8, top_k=3, bias=bias)
    for first, held in ((0, 8), (4, 4)):
        args = (x, ids, weights, w13[first:first + held], w2[first:first + held], first,
                None if b13 is None else b13[first:first + held],
                None if b2 is None else b2[first:first + held], *activation)
        want = fused_experts(*args)
        torch.testing.assert_close(one_token_experts(*args), want, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(one_token_experts, fullgraph=True)
        torch.testing.assert_close(compiled(*args), want, rtol=1e-4, atol=1e-4)


def _int8_experts(w13, w2):
    """Rows rounded as FusedExperts.quantize_int8 does: (q13, s13, q2, s2) and the
    float weights they stand for."""
    from kvserve.engine.models.quantized.int8 import quantize_int8

    out = []
    for w in (w13, w2):
        q, s = quantize_int8(w.reshape(-1, w.shape[-1]), w.dtype)
        out += [q.view(w.shape), s.view(w.shape[:2])]
    q13, s13, q2, s2 = out
    return (q13, s13, q2, s2), (q13.float() * s13[..., None], q2.float() * s2[..., None])


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("bias,activation", [(False, ("silu", 0.0, 0.0)),
                                             (True, ("swiglu_oai", 1.5, 1.702))])
def test_int8_experts_equal_float_experts_of_their_values(monkeypatch, grouped, bias,
                                                          activation):
    """int8 experts (scales per output row) give what float experts holding q * scale
    give, through the grouped GEMMs, the per-expert loop, across ranks, and in the
    one-token form a batch-1 graph compiles."""
    from kvserve.engine.kernels.moe import fused_experts as module
    from kvserve.engine.kernels.moe.fused_experts import one_token_experts

    monkeypatch.setattr(module, "GROUPED", grouped and module.GROUPED)
    x, ids, weights, w13, w2, b13, b2 = case(tokens=9, experts=8, top_k=3, bias=bias)
    (q13, s13, q2, s2), (f13, f2) = _int8_experts(w13, w2)
    for first, held in ((0, 8), (4, 4)):
        part = slice(first, first + held)
        extra = (first, None if b13 is None else b13[part], None if b2 is None else b2[part],
                 *activation)
        want = fused_experts(x, ids, weights, f13[part], f2[part], *extra)
        got = fused_experts(x, ids, weights, q13[part], q2[part], *extra, s13[part], s2[part])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        one = (x[:1], ids[:1], weights[:1])
        torch.testing.assert_close(
            one_token_experts(*one, q13[part], q2[part], *extra, s13[part], s2[part]),
            fused_experts(*one, f13[part], f2[part], *extra), rtol=1e-5, atol=1e-5)


def test_a_bf16_model_without_the_cpu_kernels_runs_torchs_gemms(monkeypatch):
    """Where kvserve's CPU kernels are not loaded (--cpu-kernels torch, a CPU
    without AVX2), bf16 experts are torch's grouped GEMMs: nothing asks the
    kernels' ops."""
    from kvserve.engine.kernels.moe import fused_experts as fe

    monkeypatch.setattr(fe, "cpu_kernels_loaded", lambda: False)
    monkeypatch.setattr(fe, "_BF16_DOTS", None)
    x, ids, weights, w13, w2, _, _ = case(dtype=torch.bfloat16)
    got = fe.fused_experts(x, ids, weights, w13, w2, 0)
    want = loop(x, ids, weights, w13, w2, None, None)
    assert (got.double() - want).norm() / want.norm() < 0.01
    assert fe._BF16_DOTS is None  # asked again once the kernels are loaded
