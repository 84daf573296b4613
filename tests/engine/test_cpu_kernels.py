"""kvserve's CPU GEMM (engine/kernels/cpu): the packed layout, the kernel against a
float64 product on every kind of shape, the op inside compiled graphs, which models
and CPUs get it (--cpu-kernels), and greedy output through it against transformers."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.kernels.cpu import build
from kvserve.engine.kernels.cpu.packing import int4_dot_rows, takes_dots
from kvserve.engine.kernels.cpu.packing import (Packed, PackedWeight, exact_in_bf16,
                                                exact_int8_groups, pack_int4, pack_int8,
                                                pack_weight, packed_linear, packed_rows,
                                                reference_product, round_int8_groups,
                                                unpack_weight)
from kvserve.engine.weights.cpu_packing import (attention_wanted, load_once, pack_model,
                                                packing_wanted)
from kvserve.engine.models.linear import Linear
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.loader import load_model
from kvserve.modelstore.errors import ModelLoadError
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import (assert_same_tokens, load_reference, reference_greedy,
                                     varied_prompts)
from tests.support.own_process import run_script_ok
from tests.support.threads import torch_threads
from tests.support.tiny_models import make_tiny_model

AVX2 = {"avx2", "fma", "f16c"}
needs_avx2 = pytest.mark.skipif(not AVX2 <= cpu_flags(),
                                reason="the kernels need AVX2, FMA and F16C")
GREEDY_48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
DOT_ROWS = int4_dot_rows()  # 12, or None (any number) with AVX512-VNNI


@pytest.fixture(scope="module")
def kernels():
    load_once()  # built once per machine (~15 s cold), then loaded from the cache


def weight(n: int, k: int, bf16_exact: bool, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return w.bfloat16().float() if bf16_exact else w


# -- the packed layout -------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(16, 8), (33, 5), (1, 1), (100, 64)])
@pytest.mark.parametrize("bf16_exact", [True, False])
def test_packing_keeps_every_value(n, k, bf16_exact):
    w = weight(n, k, bf16_exact)
    packed = pack_weight(w)
    assert packed.panels.shape == (-(-n // 16), k, 16)
    assert packed.panels.dtype == (torch.bfloat16 if bf16_exact else torch.float32)
    assert torch.equal(unpack_weight(packed, n), w)


def test_bf16_panels_only_where_every_value_is_exact():
    w = weight(32, 16, bf16_exact=True)
    assert exact_in_bf16(w)
    w[3, 5] += 2 ** -20  # one value with bits below bf16's
    assert not exact_in_bf16(w)
    assert pack_weight(w).panels.dtype == torch.float32


def test_a_bf16_panel_row_holds_columns_j_and_j_plus_8_in_word_j():
    w = torch.arange(16, dtype=torch.float32).reshape(16, 1)  # column c holds c
    row = pack_weight(w).panels[0, 0]  # the one row's 16 bf16 values, in memory order
    pairs = row.float().reshape(8, 2)  # (low half, high half) of each 32-bit word
    assert pairs[:, 0].tolist() == list(range(8))
    assert pairs[:, 1].tolist() == list(range(8, 16))


def q8_0_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """A float weight made of int8 blocks of 32, as a Q8_0 table expanded is: each
    block's largest magnitude is 127 of its float16 scale. (w, q, scales)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, ::32] = 127  # the block's largest, as Q8_0's rounding makes it
    scales = (torch.rand(k // 32, n, generator=g) * 0.02 + 1e-4).half()
    w = q.float() * scales.t().float().repeat_interleave(32, dim=1)
    return w, q, scales


def q4_1_weight(n: int, k: int, seed: int = 3) -> torch.Tensor:
    """A float weight made of Q4_1 blocks of 32, as a Q4_1 file expanded is: 4-bit
    steps of a float16 scale up from a float16 minimum, each block spanning 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q[:, ::32], q[:, 1::32] = 0, 15  # a Q4_1 block's smallest and largest
    scales = (torch.rand(k // 32, n, generator=g) * 0.02 + 1e-4).half()
    mins = (torch.randn(k // 32, n, generator=g) * 0.1).half()
    return q.float() * scales.t().float().repeat_interleave(32, dim=1) \
        + mins.t().float().repeat_interleave(32, dim=1)


def test_a_float_weight_of_int8_blocks_packs_as_int8_exactly():
    w, q, scales = q8_0_weight(40, 96)
    found = exact_int8_groups(w)
    assert found is not None and torch.equal(found[0], q) and torch.equal(found[1], scales)
    packed = pack_weight(w)
    assert packed.panels.dtype == torch.int8 and packed.scales.shape == (3, 3, 16)
    assert packed.nbytes < w.nbytes / 3
    assert torch.equal(unpack_weight(packed, 40), w)
    ids = torch.tensor([0, 15, 16, 39, 7, 7])
    assert torch.equal(packed_rows(packed, ids), w[ids])
    w[5, 70] = w[5, 70] * (1 + 2 ** -12)  # one value off its block's grid
    assert exact_int8_groups(w) is None and pack_weight(w).panels.dtype != torch.int8
    assert exact_int8_groups(torch.zeros(4, 32)) is not None  # all-zero blocks: scale 0
    assert exact_int8_groups(torch.ones(4, 33)) is None  # no whole blocks


def q8_0_values(w: torch.Tensor) -> torch.Tensor:
    q, scales = round_int8_groups(w)
    return q.float() * scales.t().float().repeat_interleave(32, dim=1)


def test_rounding_to_q8_0_keeps_each_value_within_half_a_step_of_its_group():
    w = weight(40, 96, bf16_exact=False) * 0.05
    w[3, 32:64] = 0  # an all-zero group keeps scale 0
    q, scales = round_int8_groups(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (3, 40)
    steps = scales.t().float().repeat_interleave(32, dim=1)
    assert ((q8_0_values(w) - w).abs() <= steps / 2 * (1 + 1e-3)).all()
    top = q.view(40, 3, 32).abs().amax(dim=2)
    assert top[3, 1] == 0 and scales[1, 3] == 0
    assert (top.flatten()[top.flatten() > 0] >= 126).all()  # every group spans its levels
    on_grid, q_on, scales_on = q8_0_weight(40, 96)  # a Q8_0 table's values: found again
    assert torch.equal(round_int8_groups(on_grid)[0], q_on)
    assert torch.equal(round_int8_groups(on_grid)[1], scales_on)
    assert round_int8_groups(torch.ones(4, 33)) is None  # no whole groups


@pytest.mark.parametrize("values", ["float", "bf16", "q8_0", "q4_1"])
def test_round_to_int8_packs_floats_as_q8_0_and_keeps_a_grid_it_finds(values):
    """Linear.pack(round_to_int8=True), as pack_model packs a quantized model's LM
    head: float or bf16 values are rounded to Q8_0; values already on a Q8_0 or Q4_1
    grid are packed as they are, exactly."""
    if values == "q4_1":
        w = q4_1_weight(48, 64)
    elif values == "q8_0":
        w = q8_0_weight(48, 64)[0]
    else:
        w = weight(48, 64, bf16_exact=values == "bf16")
    linear = Linear(64, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    linear.pack(round_to_int8=True)
    panels = linear.packed.panels
    assert panels.dtype == (torch.uint8 if values == "q4_1" else torch.int8)
    expected = w if values in ("q4_1", "q8_0") else q8_0_values(w)
    assert torch.equal(unpack_weight(linear.packed.contents(), 48), expected)


def test_a_float_weight_of_q4_1_blocks_packs_as_int4_exactly():
    w = q4_1_weight(48, 64)
    packed = pack_weight(w)
    assert packed.panels.dtype == torch.uint8 and packed.panels.shape == (3, 64, 8)
    assert torch.equal(unpack_weight(packed, 48), w)
    w[2, 40] = w[2, 40] + 2 ** -14  # off its block's grid
    assert pack_weight(w).panels.dtype == torch.float32


def test_int4_panels_hold_column_j_low_and_j_plus_8_high():
    q = torch.arange(16, dtype=torch.uint8).reshape(16, 1).repeat(1, 32)  # column c holds c
    ones = torch.ones(1, 16, dtype=torch.float16)
    packed = pack_int4(q, ones, torch.zeros_like(ones))
    row = packed.panels[0, 0]
    assert packed.panels.shape == (1, 32, 8)
    assert (row & 15).tolist() == list(range(8)) and (row >> 4).tolist() == list(range(8, 16))


# -- the kernel ----------------------------------------------------------------------
# int4-sym: symmetric int4 (GGUF's Q4_0, --quantization int4-sym), no minimums stored
KINDS = ("float32", "bf16", "int8", "int8-groups", "int4", "int4-sym")


def random_int4(n: int, k: int, group: int, gen: torch.Generator) -> Packed:
    """Random int4 panels of [n, k] with a float16 scale and minimum per `group`."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-4).half()
    mins = (torch.randn(k // group, n, generator=gen) * 0.1).half()
    return pack_int4(q, scales, mins)


def packed_kind(kind: str, n: int, k: int, seed: int = 0) -> tuple[Packed, torch.Tensor]:
    """A packed weight of `kind` and the float64 weight it stands for, computed
    from its integers and scales (groups of 32 where K has them, else one)."""
    if kind in ("float32", "bf16") or k == 0:
        w = weight(n, k, kind == "bf16", seed)
        return pack_weight(w), w.double()
    g = torch.Generator().manual_seed(seed)
    group = 32 if k % 32 == 0 else k
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) * 0.02 + 1e-4
        return pack_int8(q, s), q.double() * s.double()[:, None]
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 1e-4).half()
    per_input = scales.double().t().repeat_interleave(group, dim=1)
    if kind == "int8-groups":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return pack_int8(q, scales), q.double() * per_input
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    mins = (torch.randn(k // group, n, generator=g) * 0.1).half()
    if kind == "int4-sym":
        mins = -8 * scales
    w = q.double() * per_input + mins.double().t().repeat_interleave(group, dim=1)
    packed = pack_int4(q, scales, mins)
    assert (packed.mins is None) == (kind == "int4-sym")
    return packed, w


def check_product(rows: int, n: int, k: int, kind: str, bias: bool, seed: int = 0):
    packed, w = packed_kind(kind, n, k, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    got = packed_linear(x, packed, n, b, int8_inputs=True)
    want = reference_product(x, packed, n, True) + (0 if b is None else b.double())
    assert torch.equal(unpack_weight(packed, n), w.float())  # what the reference multiplies
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 sums of k products: a few units in the last place of the largest terms
    scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
    tol = 1e-6 * max(k, 1) ** 0.5 * 8 * scale
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), (
        rows, n, k, kind, bias, (got.double() - want).abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_packing_then_unpacking_gives_the_weight(kind):
    packed, w = packed_kind(kind, 37, 64)
    assert torch.equal(unpack_weight(packed, 37), w.float())


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 17, 40])
@pytest.mark.parametrize("kind", KINDS)
def test_every_row_block_and_panel_count(kernels, rows, kind):
    """Each row count a micro-kernel takes (6, and the tails of 1-5 with their own
    panel counts; quantized panels widened in registers up to 6 rows, into a buffer
    past them), over 1, 2, 3, 4, 5 and a partial panel, with and without bias."""
    for n in (16, 32, 48, 64, 80, 73):
        check_product(rows, n, 96, kind, bias=n % 2 == 1)


@needs_avx2
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_takes_integer_products_up_to_the_dot_rows_and_floats_past_them(kernels, group):
    """With int8_inputs (a quantized layer's panels) the switch between the two ways
    sits where the reference says (a row more or less and one of these fails), for
    every group size --quantization int4 takes; without (a float checkpoint's
    weights packed as int4), x stays float32 at any row count."""
    n, k = 48, 256
    gen = torch.Generator().manual_seed(group)
    packed = random_int4(n, k, group, gen)
    w = unpack_weight(packed, n).double()
    for rows in (1, DOT_ROWS, DOT_ROWS + 1) if DOT_ROWS else (1, 13, 100):
        x = torch.randn(rows, k, generator=gen) * 3
        # integer products however many rows (each part within DOT_ROWS), and exact ones
        dot = torch.cat([reference_product(part, packed, n, True)
                         for part in x.split(DOT_ROWS or rows)])
        exact = x.double() @ w.t()
        dots_here = DOT_ROWS is None or rows <= DOT_ROWS
        for int8_inputs in (True, False):
            got = packed_linear(x, packed, n, None, int8_inputs).double()
            want, other = (dot, exact) if int8_inputs and dots_here else (exact, dot)
            assert torch.equal(reference_product(x, packed, n, int8_inputs), want)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (rows, int8_inputs)
            assert not torch.allclose(got, other, rtol=1e-5, atol=1e-5), (rows, int8_inputs)


@needs_avx2
def test_integer_products_of_extreme_inputs_stay_exact(kernels):
    """Every weight 15 and every input at its block's largest (the int16 sums' worst
    case, 32 x 15 x 127), zeros (a block of step 0), and one large input beside tiny
    ones: the kernel still equals its reference."""
    n, k = 16, 96
    q = torch.full((n, k), 15, dtype=torch.uint8)
    ones = torch.ones(k // 32, n).half()
    packed = pack_int4(q, ones, torch.zeros_like(ones))
    w = unpack_weight(packed, n).double()
    x = torch.stack([torch.full((k,), -2.5), torch.zeros(k),
                     torch.cat([torch.tensor([1e4]), torch.full((k - 1,), 1e-3)])])
    got = packed_linear(x, packed, n, None, int8_inputs=True).double()
    want = reference_product(x, packed, n, int8_inputs=True)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert abs(got[0, 0].item() / (-2.5 * 15 * k) - 1) < 1e-6  # no int16 wrapped
    assert got[1].abs().max().item() == 0


@needs_avx2
@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (3, 15, 7), (0, 16, 8), (5, 17, 0),
                                       (16, 3072, 576), (2, 576, 1536), (33, 49152 // 64, 64)])
def test_shapes_of_every_kind(kernels, rows, n, k):
    for kind in KINDS:
        check_product(rows, n, k, kind, bias=True)


@needs_avx2
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), n=st.integers(1, 300), k=st.integers(1, 700),
       kind=st.sampled_from(KINDS), bias=st.booleans(), seed=st.integers(0, 1000))
def test_random_shapes(kernels, rows, n, k, kind, bias, seed):
    check_product(rows, n, k, kind, bias, seed)


@needs_avx2
def test_a_weight_several_caches_long_is_read_right(kernels):
    """The LM head's shape: thousands of panels, in several L2-sized chunks a thread."""
    check_product(9, 8192, 576, "bf16", bias=False)
    check_product(9, 8192, 576, "int4", bias=False)


@needs_avx2
@pytest.mark.parametrize("kind", KINDS)
def test_wide_layers_whichever_thread_takes_a_chunk_the_same_product(kernels, kind):
    """A layer of many L2-sized chunks a thread (chunk_schedule.h: taken from a
    counter by whichever thread is free): the same bits on 1, 2 and 3 threads, and
    the product."""
    check_product(1, 2048, 2048, kind, bias=True)
    packed, _ = packed_kind(kind, 2048, 2048)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(7))
    got = []
    for t in (1, 2, 3):
        with torch_threads(t):
            got.append(packed_linear(x, packed, 2048, None, int8_inputs=True))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


@needs_avx2
def test_rows_that_are_not_contiguous(kernels):
    w = weight(40, 24, True)
    x = torch.randn(24, 7).t()  # [7, 24], strided
    got = packed_linear(x, pack_weight(w), 40, None)
    assert torch.allclose(got, x @ w.t(), rtol=1e-5, atol=1e-5)


@needs_avx2
def test_the_op_refuses_what_it_cannot_read(kernels):
    packed = pack_weight(weight(32, 16, True))
    op = torch.ops.kvserve.packed_linear
    panels = packed.panels
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        op(torch.randn(2, 16, dtype=torch.float16), panels, 32, None)
    with pytest.raises(RuntimeError, match="values of x's dtype"):
        op(torch.randn(2, 16, dtype=torch.bfloat16), panels, 32, torch.zeros(32))
    with pytest.raises(RuntimeError, match="not packed for 8 inputs"):
        op(torch.randn(2, 8), panels, 32, None)
    with pytest.raises(RuntimeError, match="not packed for 16 inputs and 40 outputs"):
        op(torch.randn(2, 16), panels, 40, None)
    with pytest.raises(RuntimeError, match="bias must be 32"):
        op(torch.randn(2, 16), panels, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="float panels take no scales"):
        op(torch.randn(2, 16), panels, 32, None, torch.ones(32))
    int8, _ = packed_kind("int8-groups", 32, 64)
    with pytest.raises(RuntimeError, match="need float16 group scales"):
        op(torch.randn(2, 64), int8.panels, 32, None)
    with pytest.raises(RuntimeError, match="need float16 group scales"):  # 3 groups of 64?
        op(torch.randn(2, 64), int8.panels, 32, None, int8.scales[:, :1].repeat(1, 3, 1))
    int4, _ = packed_kind("int4", 32, 64)
    with pytest.raises(RuntimeError, match="need float16 group minimums"):
        op(torch.randn(2, 64), int4.panels, 32, None, int4.scales, int4.scales[:, :, :8])
    with pytest.raises(RuntimeError, match="need float16 group scales"):
        op(torch.randn(2, 64), int4.panels, 32, None, None, int4.mins)
    with pytest.raises(RuntimeError, match="packed weights are float32, bfloat16, int8"):
        op(torch.randn(2, 16), panels.to(torch.int32), 32, None)


# -- the paged decode attention ------------------------------------------------------
def paged_case(batch, length, q_heads, kv_heads, dim, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = -(-length // block_size) + 1
    blocks = batch * width + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[:batch * width].reshape(batch, width)
    lens = torch.tensor([max(1, length - 3 * i) for i in range(batch)], dtype=torch.int32)
    q = torch.randn(batch, q_heads, dim, generator=gen)
    return q, k_cache, v_cache, tables.int(), lens


PAGED_CASES = [  # batch, length, q_heads, kv_heads, dim, block_size
    (1, 1, 9, 3, 64, 16),  # one key
    (1, 300, 9, 3, 64, 16),  # a task per KV head
    (3, 17, 9, 3, 64, 16),  # across a block boundary
    (8, 150, 9, 3, 64, 16),  # a task per request
    (5, 40, 32, 8, 128, 16),  # Llama-3's grouping
    (4, 33, 14, 2, 64, 32),  # 7 query heads a KV head
    (6, 20, 4, 4, 8, 4),  # no grouping, the smallest head_dim
    (2, 70, 8, 2, 96, 16),  # a head of 96 (AVX-512 passes only for 64 and 128)
]


@needs_avx2
@pytest.mark.parametrize("batch,length,q_heads,kv_heads,dim,block_size", PAGED_CASES)
def test_paged_decode_matches_the_reference(kernels, batch, length, q_heads, kv_heads, dim,
                                            block_size):
    from kvserve.engine.kernels.attention.cpu_paged import paged_decode_reference

    q, k_cache, v_cache, tables, lens = paged_case(batch, length, q_heads, kv_heads, dim,
                                                   block_size)
    want = paged_decode_reference(q, k_cache, v_cache, tables, lens, dim ** -0.5)
    got = torch.ops.kvserve.paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5)
    assert torch.allclose(got, want, rtol=1e-5, atol=2e-6)
    # bf16: float32 maths over the bf16 values (widened, or multiplied as pairs by
    # AVX512-BF16, exactly either way), rounded once at the end, so within half a bf16
    # step (at most 2^-8 relative) of the float32 result on the same values, plus
    # float32's own difference in summation order.
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    exact = paged_decode_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                   dim ** -0.5)
    got = torch.ops.kvserve.paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), exact, rtol=2 ** -8 + 1e-5, atol=2e-6)


@needs_avx2
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("lens", [[300], [64], [300, 20], [300, 0], [250, 1, 0]])
def test_paged_decode_split_along_the_context_matches_the_reference(kernels, threads, lens):
    """Few requests on several threads: each request's context is split into runs of
    whole blocks (a request's runs past its end empty) and the parts merged."""
    from kvserve.engine.kernels.attention.cpu_paged import paged_decode_reference

    q, k_cache, v_cache, tables, _ = paged_case(len(lens), max(lens), 9, 3, 64, 16)
    lens = torch.tensor(lens, dtype=torch.int32)
    want = paged_decode_reference(q, k_cache, v_cache, tables, lens, 0.125)
    with torch_threads(threads):
        got = torch.ops.kvserve.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    empty = lens == 0
    assert torch.allclose(got[~empty], want[~empty], rtol=1e-5, atol=2e-6)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    exact = paged_decode_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                   0.125)
    with torch_threads(threads):  # bf16 caches' runs (AVX-512's passes where it has them)
        got = torch.ops.kvserve.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.allclose(got[~empty].float(), exact[~empty], rtol=2 ** -8 + 1e-5, atol=2e-6)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))


@needs_avx2
def test_paged_decode_ignores_what_lies_past_each_length(kernels):
    """Keys past a request's length (the rest of its last block, a table's padding)
    change nothing, however large; a length of 0 gives zeros, not NaNs."""
    q, k_cache, v_cache, tables, lens = paged_case(4, 40, 9, 3, 64, 16)
    op = torch.ops.kvserve.paged_decode
    before = op(q, k_cache, v_cache, tables, lens, 0.125)
    for b, n in enumerate(lens.tolist()):
        for t in range(n, tables.shape[1] * 16):
            k_cache[tables[b, t // 16], t % 16] = 1e30
    assert torch.equal(op(q, k_cache, v_cache, tables, lens, 0.125), before)
    lens[2] = 0
    out = op(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(out[:2], before[:2])


AVX512_ATTENTION = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@needs_avx2
@pytest.mark.parametrize("isa,needs", [("avx2", AVX512_ATTENTION),
                                       ("avx512", AVX512_ATTENTION | {"avx512_bf16"})])
def test_attention_other_passes_still_run_where_better_ones_would(isa, needs):
    """$KVSERVE_CPU_ISA=avx2 keeps bf16 caches on the AVX2 passes on an AVX-512 CPU (as
    a CPU without it runs them), =avx512 off AVX512-BF16's dot products (the decode's
    widening keys pass and the prompt's float32 score tiles, as Skylake-X or Ice Lake
    run them): both kernels' cases against the reference, in a process of its own
    (the ops read the variable once)."""
    if not needs <= cpu_flags():
        pytest.skip(f"no {' '.join(sorted(needs - cpu_flags()))} here: the passes "
                    f"{isa} keeps are the ones every test runs")
    script = (
        "import torch\n"
        "from kvserve.engine.weights.cpu_packing import load_once\n"
        "from tests.engine.test_cpu_kernels import PAGED_CASES, PREFILL_CASES, "
        "test_paged_decode_matches_the_reference, test_paged_prefill_matches_the_reference\n"
        "load_once()\n"
        "for case in PAGED_CASES:\n"
        "    test_paged_decode_matches_the_reference(None, *case)\n"
        "for case in PREFILL_CASES:\n"
        "    test_paged_prefill_matches_the_reference(None, *case)\n"
        "print('ok')\n")
    run_script_ok(script, {"KVSERVE_CPU_ISA": isa})


@needs_avx2
def test_paged_decode_refuses_what_it_cannot_read(kernels):
    q, k_cache, v_cache, tables, lens = paged_case(2, 10, 9, 3, 64, 16)
    op = torch.ops.kvserve.paged_decode
    with pytest.raises(RuntimeError, match="float32 or bfloat16 queries and caches, all of"):
        op(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 queries and caches"):
        op(q.half(), k_cache.half(), v_cache.half(), tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32 block_tables"):
        op(q, k_cache, v_cache, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match="a multiple of 8"):
        op(q[..., :60], k_cache[..., :60].contiguous(), v_cache[..., :60].contiguous(),
           tables, lens, 0.125)


@needs_avx2
def test_attention_takes_the_kernel_for_float32_and_bf16_caches(kernels, monkeypatch):
    """engine/kernels/attention/cpu_paged.py's attend: the op for float32 and bf16 caches, the
    reference's ops for the others (fp8, float16 here), the same result either way."""
    from kvserve.engine.kernels.attention import cpu_paged

    q, k_cache, v_cache, tables, lens = paged_case(3, 50, 9, 3, 64, 16)
    calls = []
    real = cpu_paged.paged_decode_reference
    monkeypatch.setattr(cpu_paged, "paged_decode_reference",
                        lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
    got = cpu_paged.attend(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.allclose(got, real(q, k_cache, v_cache, tables, lens, 0.125), atol=2e-6)
    b16 = [x.bfloat16() for x in (q, k_cache, v_cache)]
    got = cpu_paged.attend(*b16, tables, lens, 0.125)
    assert torch.allclose(got.float(), real(*b16, tables, lens, 0.125).float(),
                          rtol=2 ** -8, atol=2e-6)
    assert calls == []
    cpu_paged.attend(q.half(), k_cache.half(), v_cache.half(), tables, lens, 0.125)
    one = torch.ones((), dtype=torch.float32)
    cpu_paged.attend(q, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn),
                     tables, lens, 0.125, one, one)
    assert calls == [torch.float16, torch.float8_e4m3fn]


# -- the paged prefill attention -----------------------------------------------------
def prefill_case(q_len, ctx_len, q_heads, kv_heads, dim, block_size, seed=0):
    """One request's chunk of q_len queries, the last of its ctx_len positions, over a
    block table in random order with a spare block at its end."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-ctx_len // block_size) + 1
    blocks = width + 5
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:width].int()
    q = torch.randn(q_len, q_heads, dim, generator=gen)
    return q, k_cache, v_cache, table


def prefill_reference(q, k_cache, v_cache, table, ctx_len, scale):
    """The torch backend's way, in float32: the context gathered out of the cache,
    then SDPA, causal from the chunk's offset."""
    from kvserve.engine.kernels.attention.step_metadata import context_slots
    from kvserve.engine.kernels.attention.torch_backend import _prefill

    kv_heads, dim = k_cache.shape[2:]
    slots = context_slots(table, torch.arange(ctx_len), k_cache.shape[1])
    k = k_cache.float().view(-1, kv_heads, dim)[slots]
    v = v_cache.float().view(-1, kv_heads, dim)[slots]
    q_pos = torch.arange(ctx_len - q.shape[0], ctx_len)[:, None]
    return _prefill(q.float(), k, v, torch.arange(ctx_len)[None] <= q_pos, scale)


PREFILL_CASES = [  # q_len, ctx_len, q_heads, kv_heads, dim, block_size
    (1, 1, 9, 3, 64, 16),  # one query, one key
    (5, 5, 9, 3, 64, 16),  # a prompt shorter than a tile of keys
    (17, 40, 9, 3, 64, 16),  # a chunk after a cached prefix, odd sizes
    (256, 256, 9, 3, 64, 16),  # a whole prompt
    (32, 544, 9, 3, 64, 16),  # a short suffix over a long shared prefix
    (33, 70, 32, 8, 128, 16),  # Llama-3's grouping
    (19, 50, 14, 2, 64, 32),  # 7 query heads a KV head: tiles of rows with a tail
    (7, 7, 4, 4, 8, 4),  # no grouping, the smallest head_dim
    (9, 23, 10, 5, 40, 8),  # head_dim not a multiple of 32
]


@needs_avx2
@pytest.mark.parametrize("q_len,ctx_len,q_heads,kv_heads,dim,block_size", PREFILL_CASES)
def test_paged_prefill_matches_the_reference(kernels, q_len, ctx_len, q_heads, kv_heads,
                                             dim, block_size):
    q, k_cache, v_cache, table = prefill_case(q_len, ctx_len, q_heads, kv_heads, dim,
                                              block_size)
    want = prefill_reference(q, k_cache, v_cache, table, ctx_len, dim ** -0.5)
    got = torch.ops.kvserve.paged_prefill(q, k_cache, v_cache, table, ctx_len, dim ** -0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=3e-6)
    # bf16: float32 maths over the bf16 values (widened, or multiplied as pairs by
    # AVX512-BF16, exactly either way), rounded once (half a bf16 step)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    want = prefill_reference(q, k_cache, v_cache, table, ctx_len, dim ** -0.5)
    got = torch.ops.kvserve.paged_prefill(q, k_cache, v_cache, table, ctx_len, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2 ** -8 + 1e-5, atol=3e-6)


@needs_avx2
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_paged_prefill_is_the_same_on_any_number_of_threads(kernels, threads):
    q, k_cache, v_cache, table = prefill_case(45, 100, 9, 3, 64, 16, seed=4)
    want = prefill_reference(q, k_cache, v_cache, table, 100, 0.125)
    with torch_threads(threads):
        got = torch.ops.kvserve.paged_prefill(q, k_cache, v_cache, table, 100, 0.125)
    assert torch.allclose(got, want, rtol=1e-5, atol=3e-6)


@needs_avx2
def test_paged_prefill_reads_nothing_past_the_context(kernels):
    """Slots past the context (the rest of its last block, the table's spare block) and
    a query's future keys change nothing, however large."""
    q, k_cache, v_cache, table = prefill_case(12, 37, 9, 3, 64, 16, seed=2)
    op = torch.ops.kvserve.paged_prefill
    before = op(q, k_cache, v_cache, table, 37, 0.125)
    for t in range(37, table.shape[0] * 16):
        k_cache[table[t // 16], t % 16] = 1e30
        v_cache[table[t // 16], t % 16] = 1e30
    assert torch.equal(op(q, k_cache, v_cache, table, 37, 0.125), before)
    # the chunk's last key, seen by its last query only
    k_cache[table[36 // 16], 36 % 16] = 1e30
    after = op(q, k_cache, v_cache, table, 37, 0.125)
    assert torch.equal(after[:-1], before[:-1]) and not torch.equal(after[-1], before[-1])


@needs_avx2
def test_a_table_narrower_than_the_context_reads_its_last_block_again(kernels):
    """As context_slots does: the graphs' warm-up runs a long prompt over a table of the
    spare block alone, two columns wide."""
    q, k_cache, v_cache, table = prefill_case(40, 40, 9, 3, 64, 16, seed=5)
    narrow = table[:1]
    want = prefill_reference(q, k_cache, v_cache, narrow, 40, 0.125)
    got = torch.ops.kvserve.paged_prefill(q, k_cache, v_cache, narrow, 40, 0.125)
    assert torch.allclose(got, want, rtol=1e-5, atol=3e-6)


@needs_avx2
def test_paged_prefill_refuses_what_it_cannot_read(kernels):
    q, k_cache, v_cache, table = prefill_case(4, 10, 9, 3, 64, 16)
    op = torch.ops.kvserve.paged_prefill
    with pytest.raises(RuntimeError, match="float32 or bfloat16 queries and caches"):
        op(q, k_cache.bfloat16(), v_cache.bfloat16(), table, 10, 0.125)
    with pytest.raises(RuntimeError, match="an int32 block table"):
        op(q, k_cache, v_cache, table.long(), 10, 0.125)
    with pytest.raises(RuntimeError, match="an int32 block table"):
        op(q, k_cache, v_cache, table[:0], 10, 0.125)
    with pytest.raises(RuntimeError, match="at least the chunk's length"):
        op(q, k_cache, v_cache, table, 3, 0.125)
    with pytest.raises(RuntimeError, match="a multiple of 8"):
        op(q[..., :60], k_cache[..., :60].contiguous(), v_cache[..., :60].contiguous(),
           table, 10, 0.125)


# -- in compiled graphs ---------------------------------------------------------------
@needs_avx2
def test_compiled_graphs_call_the_op_for_any_row_count_without_recompiling(kernels):
    from kvserve.engine.runner.compile_process import graphs_compiled

    layer = Linear(64, 80, bias=True)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    eager = Linear(64, 80, bias=True)
    eager.load_state_dict(layer.state_dict())
    layer.pack()

    def fn(x):
        return torch.nn.functional.silu(layer(x)) * 2

    compiled = torch.compile(fn)
    before = graphs_compiled()
    with torch.inference_mode():
        for rows in (2, 5, 9, 33):
            x = torch.randn(rows, 64)
            torch._dynamo.mark_dynamic(x, 0)
            want = torch.nn.functional.silu(eager(x)) * 2
            assert torch.allclose(compiled(x), want, rtol=1e-5, atol=1e-5)
    assert graphs_compiled() - before == 1


# -- which models and CPUs ------------------------------------------------------------
CPU, F32 = torch.device("cpu"), torch.float32


def test_auto_loads_the_attention_kernel_on_every_avx2_cpu_for_float32_and_bf16():
    avx512 = AVX2 | {"avx512f", "avx512_bf16"}
    for flags, dtype in [(AVX2, F32), (AVX2, torch.bfloat16), (avx512, F32),
                         (avx512, torch.bfloat16)]:
        assert attention_wanted("auto", CPU, dtype, flags)
        assert attention_wanted("kvserve", CPU, dtype, flags)
    assert not attention_wanted("torch", CPU, torch.bfloat16, avx512)
    assert not attention_wanted("auto", CPU, torch.float16, avx512)
    assert not attention_wanted("auto", CPU, torch.bfloat16, {"avx2", "avx512f"})  # no FMA
    assert not attention_wanted("auto", torch.device("cuda"), torch.bfloat16, avx512)


def test_auto_packs_float32_on_avx2_cpus_without_avx512():
    assert packing_wanted("auto", CPU, F32, {"avx2", "fma", "f16c"})
    assert not packing_wanted("auto", CPU, F32, {"avx2", "fma", "f16c", "avx512f"})
    assert not packing_wanted("auto", CPU, F32, {"avx2"})  # no FMA
    assert not packing_wanted("auto", CPU, torch.bfloat16, {"avx2", "fma", "f16c"})
    assert not packing_wanted("auto", torch.device("cuda"), F32, {"avx2", "fma", "f16c"})
    assert not packing_wanted("torch", CPU, F32, {"avx2", "fma", "f16c"})
    assert packing_wanted("kvserve", CPU, F32, {"avx2", "fma", "f16c", "avx512f"})


@pytest.mark.parametrize("device,dtype,flags,match", [
    (CPU, torch.bfloat16, {"avx2", "fma", "f16c"}, "needs a CPU with avx512f.*avx512_bf16 "
     "for bfloat16"),
    (CPU, torch.float16, {"avx2", "fma", "f16c"}, "runs float32 or bfloat16 on CPU"),
    (torch.device("cuda"), F32, {"avx2", "fma", "f16c"}, "runs float32 or bfloat16 on CPU"),
    (CPU, F32, {"avx2", "f16c"}, "needs a CPU with fma"),
    (CPU, F32, set(), "needs a CPU with avx2, fma"),
])
def test_kvserve_where_it_cannot_run_stops_start_up(device, dtype, flags, match):
    with pytest.raises(ModelLoadError, match=match):
        packing_wanted("kvserve", device, dtype, flags)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ModelLoadError, match="unknown --cpu-kernels 'fast'"):
        packing_wanted("fast", CPU, F32, {"avx2", "fma", "f16c"})


def test_avx512_loads_the_kernels_for_attention_and_packs_nothing(monkeypatch, caplog):
    """Where oneDNN keeps the GEMMs (AVX-512, bf16), auto still loads the kernels, for
    the attention; --cpu-kernels torch loads nothing."""
    from kvserve.engine.weights import cpu_packing as setup

    loads = []
    monkeypatch.setattr(setup, "load_once", lambda: loads.append(1))
    model = torch.nn.Sequential(Linear(8, 8)).bfloat16()
    avx512 = AVX2 | {"avx512f", "avx512_bf16"}
    with caplog.at_level(logging.INFO, logger="kvserve.cpu_kernels"):
        assert pack_model(model, "auto", CPU, torch.bfloat16, avx512) == 0
    assert loads == [1] and model[0].weight is not None
    assert "the paged attention of decodes and prompts (bfloat16 caches)" in caplog.text
    assert pack_model(model, "torch", CPU, torch.bfloat16, avx512) == 0 and loads == [1]


def test_a_failed_build_leaves_torch_under_auto_and_stops_kvserve(monkeypatch, caplog):
    from kvserve.engine.weights import cpu_packing as setup

    def fail():
        raise build.BuildError("no C++ compiler found (g++ or $CXX)")

    monkeypatch.setattr(setup, "load_once", fail)
    model = torch.nn.Sequential(Linear(8, 8))
    with caplog.at_level(logging.WARNING, logger="kvserve.cpu_kernels"):
        assert pack_model(model, "auto", CPU, F32, {"avx2", "fma", "f16c"}) == 0
    assert "no C++ compiler found" in caplog.text and model[0].weight is not None
    with pytest.raises(ModelLoadError, match="--cpu-kernels kvserve: no C\\+\\+ compiler"):
        pack_model(model, "kvserve", CPU, F32, {"avx2", "fma", "f16c"})


def test_a_failed_compile_says_why_and_leaves_no_file(tmp_path):
    target = tmp_path / "cpu_kernels" / "kernels-test.so"
    with pytest.raises(build.BuildError, match=f"failed to build {build.UNITS['packed_gemm'][0].name}"):
        build._build("false", target)  # `false`: a compiler that always fails
    assert list(target.parent.iterdir()) == []


def test_package_data_ships_the_kernel_source():
    """A non-editable install keeps the .cpp that build.py compiles on the target."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["kvserve.engine.kernels.cpu"]
    folder = build.SOURCES[0].parent
    assert set(build.SOURCES) | set(build.HEADERS) <= {p for g in globs for p in folder.glob(g)}
    assert {h.name for h in build.HEADERS} == {"attention_isa.h", "attention_shared.h",
                                                "bf16_pairs_amx.h", "bf16_rows.h",
                                                "chunk_schedule.h", "expert_bf16_dots.h",
                                                "expert_int8_dots.h", "expert_linear.h",
                                                "int8_inputs.h", "isa_built.h",
                                                "paged_decode_avx512.h",
                                                "paged_prefill_bf16_dots.h", "vnni_dots.h"}
    assert {s.name for s in build.SOURCES} == {"bf16_pairs.cpp", "expert_linear.cpp",
                                               "moe_experts.cpp",
                                               "packed_gemm.cpp", "paged_decode.cpp",
                                               "paged_prefill.cpp"}


def test_the_library_name_follows_the_sources_headers_and_compiler(tmp_path, monkeypatch):
    first = build.library_path(tmp_path, "g++")
    assert build.library_path(tmp_path, "clang++") != first
    changed = tmp_path / "packed_gemm.cpp"
    changed.write_text(build.SOURCES[0].read_text() + "// changed\n")
    monkeypatch.setattr(build, "SOURCES", (changed, *build.SOURCES[1:]))
    assert build.library_path(tmp_path, "g++") != first
    monkeypatch.setattr(build, "SOURCES", build.SOURCES)
    header = tmp_path / "attention_shared.h"
    header.write_text(build.HEADERS[0].read_text() + "// changed\n")
    monkeypatch.setattr(build, "HEADERS", (header,))
    assert build.library_path(tmp_path, "g++") != first


@pytest.fixture(scope="module")
def tied_bf16_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied-bf16"), dtype=torch.bfloat16,
                           tie_word_embeddings=True)


@needs_avx2
def test_pack_model_packs_every_float32_linear_and_keeps_the_embedding(kernels,
                                                                        tied_bf16_dir):
    from kvserve.engine.config.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(str(tied_bf16_dir))
    plain = load_model(tied_bf16_dir, cfg, F32, CPU, 256)
    model = load_model(tied_bf16_dir, cfg, F32, CPU, 256)
    table = model.embed_tokens.weight.detach().clone()
    assert pack_model(model, "kvserve", CPU, F32) == 4 * cfg.num_layers + 1
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None and m.packed.panels.dtype == torch.bfloat16 for m in linears)
    assert torch.equal(unpack_weight(model.lm_head.packed.contents(), cfg.vocab_size), table)
    # One copy of the tied table: the embedding looks its rows up in the head's panels.
    assert model.embed_tokens.weight is None and model.embed_tokens.packed is model.lm_head.packed
    ids = torch.tensor([0, 7, 8, 15, 16, cfg.vocab_size - 1, 3, 3])
    x = torch.randn(5, cfg.hidden_size)
    with torch.inference_mode():
        assert torch.equal(model.embed_tokens(ids), table[ids])
        for part in (lambda m: m.layers[1].mlp(x), lambda m: m.compute_logits(x)):
            assert torch.allclose(part(model), part(plain), rtol=1e-5, atol=1e-5)


@needs_avx2
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
def test_quantized_layers_packed_compute_what_they_did(kernels, kind, rows):
    """--quantization int8 / int4 and a GGUF's Q8_0 blocks: the layer packed for the
    kernel reads its own integers and scales (no float copy) and gives the products
    it gave before, bias included."""
    from kvserve.engine.models.quantized.int4 import Int4Linear
    from kvserve.engine.models.quantized.int8 import GroupInt8Linear, Int8Linear

    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 64, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 96, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(64, generator=gen))
    if kind == "int8":
        layer = Int8Linear.of(linear)
    elif kind == "int4":
        layer = Int4Linear.of(linear, 32)
    else:
        q = torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8)
        scales = (torch.rand(3, 64, generator=gen) * 0.01).half()
        layer = GroupInt8Linear(q, scales, linear.bias.data, torch.float32)
    x = torch.randn(2, rows, 96, generator=gen)
    with torch.inference_mode():
        before = layer(x)
        assert layer.pack()
        after = layer(x)
    panels = layer.packed.panels
    assert panels.dtype == (torch.uint8 if kind == "int4" else torch.int8)
    assert not any(t is not None and t.dtype.is_floating_point and t.numel() >= 64 * 96
                   for t in layer.buffers())  # no float copy of the weights
    assert after.shape == before.shape == (2, rows, 64)
    flat = x.reshape(-1, 96)
    if takes_dots(layer.packed.contents(), len(flat), 96):  # x quantized: the same weights
        w = unpack_weight(layer.packed.contents(), 64).double()
        torch.testing.assert_close(before.reshape(-1, 64).double(),
                                   flat.double() @ w.t() + linear.bias.double(),
                                   rtol=1e-4, atol=1e-4)
        before = (reference_product(flat, layer.packed.contents(), 64, int8_inputs=True)
                  + linear.bias.double()).float().reshape(before.shape)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@needs_avx2
def test_pack_model_packs_quantized_layers_too(kernels, tied_bf16_dir):
    """(int4 layers need rows in blocks of 64, more than the tiny model has: the GGUF
    tests serve them through the kernel, tests/engine/test_gguf_loading.py.)"""
    from kvserve.engine.config.model_config import ModelConfig
    from kvserve.engine.weights.quantization import quantize_model

    cfg = ModelConfig.from_pretrained(str(tied_bf16_dir))
    model = load_model(tied_bf16_dir, cfg, F32, CPU, 256)
    quantize_model(model, "int8")
    x = torch.randn(3, cfg.hidden_size)
    mlp = model.layers[0].mlp
    with torch.inference_mode():
        before = mlp(x)
        assert pack_model(model, "kvserve", CPU, F32) == 4 * cfg.num_layers + 1
        after = mlp(x)
        kinds = {m.packed.panels.dtype for m in model.layers[0].modules()
                 if isinstance(getattr(m, "packed", None), PackedWeight)}
        assert kinds == {torch.int8}
        gate_up = mlp.gate_up_proj.packed
        if not takes_dots(gate_up.contents(), len(x), cfg.hidden_size):
            torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
            return
        # VNNI: x quantized to int8 as well, so the layer's own product is the
        # reference's and the MLP's within the inputs' rounding
        torch.testing.assert_close(
            mlp.gate_up_proj(x).double(),
            reference_product(x, gate_up.contents(), mlp.gate_up_proj.out_features, True),
            rtol=1e-5, atol=1e-5)
        assert (after - before).norm() / before.norm() < 0.02


@needs_avx2
def test_a_quantized_models_lm_head_and_tied_table_are_packed_as_q8_0(kernels, tied_bf16_dir,
                                                                      caplog):
    """pack_model(int8_head=True), as the engine packs a model whose decoder
    --quantization int8 / int4 quantized: the bf16 LM head is rounded to Q8_0 (half
    its bytes read each step, as llama.cpp's Q8_0 files hold it) and the tied
    embedding looks its rows up in those panels, so both read the same values."""
    from kvserve.engine.config.model_config import ModelConfig
    from kvserve.engine.weights.quantization import quantize_model

    cfg = ModelConfig.from_pretrained(str(tied_bf16_dir))
    model = load_model(tied_bf16_dir, cfg, F32, CPU, 256)
    quantize_model(model, "int8")
    table = q8_0_values(model.embed_tokens.weight.detach())
    assert not torch.equal(table, model.embed_tokens.weight)  # bf16 values, off the grid
    with caplog.at_level(logging.INFO, logger="kvserve.cpu_kernels"):
        assert pack_model(model, "kvserve", CPU, F32, int8_head=True) == 4 * cfg.num_layers + 1
    assert "LM head and tied embedding packed as int8" in caplog.text
    head = model.lm_head.packed
    assert head.panels.dtype == torch.int8 and head.scales.dtype == torch.float16
    assert model.embed_tokens.packed is head
    assert torch.equal(unpack_weight(head.contents(), cfg.vocab_size), table)
    ids = torch.tensor([0, 7, 8, 15, 16, cfg.vocab_size - 1, 3, 3])
    x = torch.randn(5, cfg.hidden_size)
    with torch.inference_mode():
        assert torch.equal(model.embed_tokens(ids), table[ids])
        # the head takes x quantized to int8 where the kernel does (VNNI), as llama.cpp's
        torch.testing.assert_close(model.compute_logits(x).double(),
                                   reference_product(x, head.contents(), cfg.vocab_size, True),
                                   rtol=1e-5, atol=1e-5)


@needs_avx2
@pytest.mark.parametrize("quantization,head", [("none", torch.bfloat16), ("int8", torch.int8),
                                               ("int8-awq", torch.int8)])
def test_the_engine_rounds_the_head_to_q8_0_only_for_a_quantized_decoder(
        tied_bf16_dir, quantization, head):
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    engine = Engine(EngineConfig(model=str(tied_bf16_dir), dtype="float32", compile="off",
                                 cpu_kernels="kvserve", quantization=quantization,
                                 num_kv_blocks=64, max_model_len=256))
    assert engine.runner.model.lm_head.packed.panels.dtype == head
    assert len(engine.generate([[5, 6, 7]], GREEDY_48)[0]) == 48


@pytest.mark.parametrize("bf16_exact", [True, False])
def test_rows_looked_up_in_packed_panels_are_the_weights_rows(bf16_exact):
    w = weight(37, 24, bf16_exact)
    ids = torch.tensor([0, 1, 7, 8, 9, 15, 16, 31, 32, 36, 5, 5])
    assert torch.equal(packed_rows(pack_weight(w), ids), w[ids])


# -- end to end -----------------------------------------------------------------------
@needs_avx2
@pytest.mark.parametrize("arch,dtype,compile_mode", [
    ("llama", torch.bfloat16, "wait"),  # bf16 panels, compiled graphs
    ("qwen2", torch.float32, "off"),  # float32 panels, q/k/v biases, eager
])
def test_greedy_output_matches_torch_and_transformers(tmp_path, arch, dtype, compile_mode):
    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine

    model_dir = make_tiny_model(tmp_path / arch, arch=arch, dtype=dtype)

    def engine(cpu_kernels, compile):
        return Engine(EngineConfig(model=str(model_dir), dtype="float32", cpu_kernels=cpu_kernels,
                                   compile=compile, num_kv_blocks=256,
                                   max_num_batched_tokens=37))

    packed = engine("kvserve", compile_mode)
    prompts = varied_prompts(packed.model_config.vocab_size, count=6, seed=3)
    got = []
    for batch in (1, 2, 3):  # decode steps of one request and of several
        got += packed.generate(prompts[len(got):len(got) + batch], GREEDY_48)
    ref = load_reference(model_dir)
    assert_same_tokens(ref, prompts, got, engine("torch", "off").generate(prompts, GREEDY_48))
    assert_same_tokens(ref, prompts, got, [reference_greedy(ref, p, 48) for p in prompts])
    assert packed.scheduler.kv.num_free_blocks == packed.scheduler.kv.num_blocks
