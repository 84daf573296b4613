"""kvserve's CPU GEMM under a bf16 model: the op takes bf16 rows (summed in float32,
rounded back at the end), and on AVX-512 CPUs without AVX512-BF16, where oneDNN keeps
the float GEMMs, auto still packs a quantized model's int8 / int4 layers and rounds
its LM head to Q8_0 (cpu_packing.quantized_packing_wanted). With AVX512-BF16 the
float layers are packed too (tests/engine/test_bf16_pairs.py)."""
from __future__ import annotations

import logging

import pytest
import torch

from kvserve.engine.kernels.cpu.packing import (INT4_DOT_ROWS, ONEDNN_ROWS, int4_dot_rows,
                                                pack_int8, pack_weight, reference_product,
                                                takes_dots, unpack_weight)
from kvserve.engine.models.linear import Linear
from kvserve.engine.models.quantized.layer import QuantizedLinear
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import (load_once, pack_model,
                                                quantized_packing_wanted)
from kvserve.engine.weights.loader import load_model
from tests.engine.test_cpu_kernels import packed_kind, random_int4
from tests.support.own_process import run_script_ok
from tests.support.tiny_gguf import INT4_SHAPES
from tests.support.tiny_models import make_tiny_model

AVX2 = {"avx2", "fma", "f16c"}
# AVX-512 without its bf16 dot products (Skylake-X, Ice Lake): oneDNN keeps float layers
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
CPU = torch.device("cpu")
BF16 = torch.bfloat16
needs_avx2 = pytest.mark.skipif(not AVX2 <= cpu_flags(),
                                reason="the kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module")
def kernels():
    load_once()


def through_onednn(kind: str, rows: int) -> bool:
    """Whether the op's bf16 matrix and oneDNN take these rows, told int8_inputs=False
    (with True, integer products come first where the panels take them: takes_dots)."""
    return kind not in ("float32", "bf16") and rows > ONEDNN_ROWS and \
        "avx512_bf16" in cpu_flags()


@needs_avx2
@pytest.mark.parametrize("kind", ["float32", "bf16", "int8", "int8-groups", "int4", "int4-sym"])
@pytest.mark.parametrize("rows", [1, 5, 13, ONEDNN_ROWS])
def test_bf16_rows_give_the_float32_product_rounded_to_bf16(kernels, kind, rows):
    """The op widens bf16 rows (exact) and the bias, sums as it does for float32
    rows, and rounds once: bit for bit the float32 call's product in bf16."""
    assert not through_onednn(kind, rows)
    packed, _ = packed_kind(kind, 40, 64)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).to(BF16)
    bias = torch.randn(40, generator=gen).to(BF16)
    op = torch.ops.kvserve.packed_linear
    for int8_inputs in (False, True):
        got = op(x, packed.panels, 40, bias, packed.scales, packed.mins, int8_inputs)
        want = op(x.float(), packed.panels, 40, bias.float(), packed.scales, packed.mins,
                  int8_inputs)
        assert got.dtype == BF16 and got.shape == (rows, 40)
        assert torch.equal(got, want.to(BF16))


@needs_avx2
@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="oneDNN's bf16 GEMM is slow here")
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "int4", "int4-sym"])
@pytest.mark.parametrize("rows,n,k", [(ONEDNN_ROWS + 1, 40, 64), (70, 100, 320),
                                      (130, 33, 96)])
def test_many_bf16_rows_go_through_a_bf16_matrix_and_onednn(kernels, kind, rows, n, k):
    """Past ONEDNN_ROWS bf16 rows a quantized weight that takes no integer products is
    widened into a plain bf16 matrix (its values rounded once to bf16) for oneDNN's
    bf16 GEMM: the product of x and those rounded values, summed in float32."""
    assert through_onednn(kind, rows)
    packed, _ = packed_kind(kind, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    got = torch.ops.kvserve.packed_linear(x, packed.panels, n, bias, packed.scales,
                                          packed.mins, False)
    assert got.dtype == BF16 and got.shape == (rows, n) and got.is_contiguous()
    matrix = unpack_weight(packed, n).to(BF16).double()  # the bf16 matrix's values
    want = x.double() @ matrix.t() + bias.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
    # the same call again: the matrix buffer is reused (and across the cases, resized)
    again = torch.ops.kvserve.packed_linear(x, packed.panels, n, bias, packed.scales,
                                            packed.mins, False)
    assert torch.equal(again, got)
    # told int8_inputs, the op takes integer products instead wherever it can (VNNI)
    dots = torch.ops.kvserve.packed_linear(x, packed.panels, n, bias, packed.scales,
                                           packed.mins, True)
    assert torch.equal(dots, got) != takes_dots(packed, rows, k)


@needs_avx2
@pytest.mark.skipif(int4_dot_rows() is not None, reason="no VNNI here: integer products "
                    "stop at a few rows")
@pytest.mark.parametrize("kind", ["int8", "int8-groups", "int4", "int4-sym"])
@pytest.mark.parametrize("rows", [ONEDNN_ROWS + 1, 200, 517])
def test_vnni_takes_integer_products_at_prompt_sizes(kernels, kind, rows):
    """With VNNI a quantized layer's panels (int8_inputs) take integer products at
    any number of rows, a prompt chunk's too: the reference's product of x quantized
    to int8, every row block and the panels' tail (n = 72) included."""
    n, k = 72, 128
    packed, _ = packed_kind(kind, n, k, seed=rows)
    assert takes_dots(packed, rows, k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    op = torch.ops.kvserve.packed_linear
    got = op(x, packed.panels, n, bias, packed.scales, packed.mins, True)
    got32 = op(x.float(), packed.panels, n, bias.float(), packed.scales, packed.mins, True)
    assert got.dtype == BF16 and got.shape == (rows, n)
    assert torch.equal(got, got32.to(BF16))  # summed in float32, rounded once
    want = reference_product(x.float(), packed, n, True) + bias.double()
    exact = x.double() @ unpack_weight(packed, n).double().t() + bias.double()
    close = dict(rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(got32.double(), want, **close)
    assert not torch.allclose(got32.double(), exact, **close)


@needs_avx2
@pytest.mark.skipif(int4_dot_rows() is not None, reason="no VNNI here")
@pytest.mark.parametrize("group", [32, 64, 128])
def test_vnni_one_row_kernel_gives_the_many_row_kernels_sums(kernels, group):
    """A decode's one row of int4 takes its own 512-bit kernel (micro_dot_vnni_row):
    each row of a 3-row product (micro_dot_vnni) equals that row alone, bit for bit,
    over whole panel pairs, a single panel and a partial one (n = 72), and the
    reference's integer products."""
    n, k = 72, 512
    gen = torch.Generator().manual_seed(group)
    packed = random_int4(n, k, group, gen)
    x = torch.randn(3, k, generator=gen) * 3
    op = torch.ops.kvserve.packed_linear
    together = op(x, packed.panels, n, None, packed.scales, packed.mins, True)
    for row in range(3):
        alone = op(x[row:row + 1], packed.panels, n, None, packed.scales, packed.mins, True)
        assert torch.equal(alone, together[row:row + 1])
        torch.testing.assert_close(alone.double(),
                                   reference_product(x[row:row + 1], packed, n, True),
                                   rtol=1e-5, atol=1e-5)

@pytest.mark.skipif(int4_dot_rows() is not None, reason="no VNNI here")
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 10])
def test_vnni_many_row_kernel_at_every_row_count(kernels, group, rows):
    """micro_dot_vnni at each of its row counts (2-6, and 6 + 4), groups of one block
    and of four, equals the reference's integer products."""
    n, k = 72, 512
    gen = torch.Generator().manual_seed(group + rows)
    packed = random_int4(n, k, group, gen)
    x = torch.randn(rows, k, generator=gen) * 3
    got = torch.ops.kvserve.packed_linear(x, packed.panels, n, None, packed.scales,
                                          packed.mins, True)
    torch.testing.assert_close(got.double(), reference_product(x, packed, n, True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(int4_dot_rows() is not None, reason="no VNNI here")
@pytest.mark.parametrize("group", [None, 32, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 10])
def test_vnni_int8_kernel_at_every_row_count(kernels, group, rows):
    """micro_dot_i8_vnni (weights made unsigned, x's block sums taken off) at each of
    its row counts, with a scale per column (group None) or per group of one block and
    of four, equals the reference's integer products; the weights' extremes -128 and
    127 included, where w + 128 is 0 and 255."""
    n, k = 72, 512
    gen = torch.Generator().manual_seed(rows + (group or 0))
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, :] = -128
    q[1, :] = 127
    scales = (torch.rand(n, generator=gen) * 0.02 + 1e-4 if group is None
              else (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-4).half())
    packed = pack_int8(q, scales)
    x = torch.randn(rows, k, generator=gen) * 3
    assert takes_dots(packed, rows, k)
    got = torch.ops.kvserve.packed_linear(x, packed.panels, n, None, packed.scales,
                                          packed.mins, True)
    torch.testing.assert_close(got.double(), reference_product(x, packed, n, True),
                               rtol=1e-5, atol=1e-5)


def test_auto_packs_quantized_layers_under_bf16_wherever_the_kernels_run():
    assert quantized_packing_wanted("auto", CPU, BF16, AVX512)
    assert quantized_packing_wanted("auto", CPU, BF16, AVX2)
    assert quantized_packing_wanted("auto", CPU, torch.float32, AVX2)  # as the float layers
    assert not quantized_packing_wanted("auto", CPU, torch.float32, AVX512)  # oneDNN's float32
    assert not quantized_packing_wanted("auto", CPU, torch.float16, AVX512)
    assert not quantized_packing_wanted("auto", CPU, BF16, {"avx2", "avx512f"})  # no FMA
    assert not quantized_packing_wanted("torch", CPU, BF16, AVX512)
    assert not quantized_packing_wanted("auto", torch.device("cuda"), BF16, AVX512)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    # rows in blocks of 64, as int4 quantization keeps them (torch's int4 layout)
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied-bf16"), dtype=BF16,
                           tie_word_embeddings=True, **INT4_SHAPES)


@needs_avx2
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_bf16_quantized_model_is_packed_on_avx512_and_computes_the_same(
        kernels, tied_dir, quantization, caplog):
    """auto on an AVX-512 CPU (the flags given): the quantized layers read their
    panels, the head is rounded to Q8_0 and the tied table reads its panels in bf16;
    the logits stay those of torch's kernels over the same weights (bf16 rounding
    apart), the head's share computed from the Q8_0 values."""
    from kvserve.engine.config.model_config import ModelConfig
    from kvserve.engine.weights.quantization import quantize_model

    cfg = ModelConfig.from_pretrained(str(tied_dir))
    model = load_model(tied_dir, cfg, BF16, CPU, 256)
    quantize_model(model, quantization)
    ids = torch.tensor([1, 5, 9, 17, 33, 2, 7])
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    inputs = [torch.randn(3, m.in_features).to(BF16) for m in quantized]
    with torch.inference_mode():
        before = model.embed_tokens(ids).float()
        torch_products = [m(x).float() for m, x in zip(quantized, inputs)]
    with caplog.at_level(logging.INFO, logger="kvserve.cpu_kernels"):
        packed = pack_model(model, "auto", CPU, BF16, AVX512, int8_head=True)
    assert packed == len(quantized) + 1 and all(m.packed is not None for m in quantized)
    assert "LM head and tied embedding packed as int8" in caplog.text
    assert ", bfloat16 elsewhere" in caplog.text
    head = model.lm_head.packed
    assert head.panels.dtype == torch.int8 and model.embed_tokens.packed is head
    table = unpack_weight(head.contents(), cfg.vocab_size)
    with torch.inference_mode():
        rows = model.embed_tokens(ids)
        assert rows.dtype == BF16
        torch.testing.assert_close(rows.float(), before, rtol=0.02, atol=0.02)
        assert torch.equal(rows, table[ids].to(BF16))
        x = torch.randn(4, cfg.hidden_size).to(BF16)
        logits = reference_product(x.float(), head.contents(), cfg.vocab_size, True)
        torch.testing.assert_close(model.compute_logits(x).double(), logits.to(BF16).double(),
                                   rtol=0.01, atol=1e-3)
        assert (logits.float() - x.float() @ table.t()).norm() / logits.norm() < 0.02
        for m, x, want in zip(quantized, inputs, torch_products):
            got = m(x)
            assert got.dtype == BF16
            # the kernel's own product (int4 layers take x quantized to int8 at a few
            # rows, llama.cpp's way), then rounded once to bf16
            exact = reference_product(x.float(), m.packed.contents(), m.out_features, True)
            torch.testing.assert_close(got.double(), exact, rtol=0.01, atol=1e-3)
            assert (got.float() - want).norm() / want.norm() < 0.02  # torch's, within that


@needs_avx2
def test_a_plain_bf16_model_keeps_onednn_on_avx512(kernels, tied_dir):
    """No quantized layer and no AVX512-BF16: nothing packed, the head stays bf16 for
    oneDNN."""
    from kvserve.engine.config.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(str(tied_dir))
    model = load_model(tied_dir, cfg, BF16, CPU, 256)
    assert pack_model(model, "auto", CPU, BF16, AVX512, int8_head=True) == 0
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    assert model.lm_head.weight.dtype == BF16


def test_pack_weight_takes_bf16_weights_through_linear_pack():
    """Linear.pack widens a bf16 weight first (pack_weight packs float32)."""
    linear = Linear(64, 32, bias=False).to(BF16)
    w = linear.weight.detach().float().clone()
    linear.pack()
    assert linear.weight is None
    assert torch.equal(unpack_weight(linear.packed.contents(), 32), w)
    assert torch.equal(pack_weight(w).panels, linear.packed.panels)


@needs_avx2
@pytest.mark.skipif(int4_dot_rows() == INT4_DOT_ROWS, reason="no VNNI here: the AVX2 "
                    "integer products are what every other test runs")
def test_the_avx2_integer_products_still_run_where_vnni_would(tmp_path):
    """$KVSERVE_NO_VNNI makes a VNNI CPU take micro_dot (vpmaddubsw) for int4 panels
    and the float widening for int8 ones, as a CPU without VNNI does: every row block
    and a partial panel against the reference, in a process of its own (the op reads
    the variable once)."""
    script = (
        "import os, torch\n"
        "from kvserve.engine.weights.cpu_packing import load_once\n"
        "from kvserve.engine.kernels.cpu.packing import int4_dot_rows, INT4_DOT_ROWS\n"
        "from tests.engine.test_cpu_kernels import check_product\n"
        "load_once()\n"
        "assert int4_dot_rows() == INT4_DOT_ROWS\n"
        "for kind in ('int4', 'int4-sym', 'int8', 'int8-groups'):\n"
        "    for rows in (1, 2, 3, 6, 7, 12, 13):\n"
        "        for n in (16, 48, 73):\n"
        "            check_product(rows, n, 96, kind, bias=n % 2 == 1)\n"
        "print('ok')\n")
    run_script_ok(script, {"KVSERVE_NO_VNNI": "1"})


@needs_avx2
def test_bf16_products_sum_into_a_kept_buffer_without_sharing_their_outputs(kernels):
    """A bf16 product's float32 sums go to a buffer the thread keeps across calls
    (float_sums_buffer: a fresh one past 32 MiB was faulted in on every call): each
    call's output is its own tensor, left as it was by the calls after it, through a
    product that grows the buffer and a smaller one after it."""
    packed, _ = packed_kind("int4", 72, 128)
    gen = torch.Generator().manual_seed(7)
    op = torch.ops.kvserve.packed_linear
    row_counts = (2, ONEDNN_ROWS, 1)  # more would go to oneDNN where it is fast
    assert not any(through_onednn("int4", rows) for rows in row_counts)
    calls = [torch.randn(rows, 128, generator=gen).to(BF16) for rows in row_counts]
    outs = [op(x, packed.panels, 72, None, packed.scales, packed.mins, True) for x in calls]
    for x, got in zip(calls, outs):
        want = op(x.float(), packed.panels, 72, None, packed.scales, packed.mins, True)
        assert torch.equal(got, want.to(BF16))
    assert len({o.data_ptr() for o in outs}) == len(outs)
