"""A bf16 model's float layers on kvserve's AVX512-BF16 GEMM (engine/kernels/cpu/
bf16_pairs.{cpp,py}) and, where the CPU has AMX-BF16, on its tiles over the same
panels (bf16_pairs_amx.h): pair panels hold the weight exactly; each kernel's product
is the exact one rounded once to bf16 (within a unit in the last place: the float32
sums' own rounding), at decode and prompt row counts, over several K slabs, ragged
panels and with a bias, and a row's the same however many rows share the call;
bad inputs are refused; the policy packs bf16 models' float layers
where the CPU has the instructions (cpu_packing.packing_wanted), a tied embedding
reads its head's panels, and a model's outputs stay oneDNN's within bf16's rounding."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.cpu.bf16_pairs import (PAIRS_FLAGS, amx_here, bf16_linear,
                                                   bf16_pairs_here, is_pairs, pack_bf16_pairs,
                                                   pairs_rows, pairs_values)
from kvserve.engine.kernels.cpu.packing import pack_weight, unpack_weight
from kvserve.engine.models.linear import Linear
from kvserve.engine.weights.cpu_packing import load_once, pack_model, packing_wanted
from kvserve.modelstore.errors import ModelLoadError
from tests.support.threads import torch_threads

BF16 = torch.bfloat16
CPU = torch.device("cpu")
AVX2 = {"avx2", "fma", "f16c"}
PAIRS = AVX2 | set(PAIRS_FLAGS)
needs_pairs = pytest.mark.skipif(not (AVX2 <= PAIRS and bf16_pairs_here()),
                                 reason="this CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def kernels():
    load_once()


@pytest.fixture(params=["avx512", "amx"])
def kernel(request, kernels):
    """Each kernel bf16_linear_on can name that this CPU runs."""
    if request.param == "amx" and not amx_here():
        pytest.skip("this CPU (or this process) has no AMX-BF16")
    return request.param


def test_pair_panels_hold_the_weight_exactly():
    """Every value where it belongs (the last panel padded with zeros), rows looked
    up as a tied embedding would, and no panels where K is odd or a value is not
    exact in bf16."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 10, generator=gen).to(BF16)
    panels = pack_bf16_pairs(w)
    assert panels.shape == (3, 5, 32) and panels.dtype == BF16 and is_pairs(panels)
    assert panels[0, 1, 2 * 3 + 1] == w[3, 2 * 1 + 1]  # (p, k, 2j + i) = W[16p + j, 2k + i]
    assert torch.equal(pairs_values(panels, 37), w.float())
    assert not panels[2, :, 2 * 5:].any()  # columns 37..47: padding
    ids = torch.tensor([0, 36, 17, 17])
    assert torch.equal(pairs_rows(panels, ids), w[ids].float())
    assert pack_bf16_pairs(torch.randn(4, 9).to(BF16)) is None
    assert pack_bf16_pairs(torch.randn(4, 8, generator=gen)) is None  # float32 values
    for weight in (w, w.float()):  # a bf16 model's weight, or its values in float32
        packed = pack_weight(weight, bf16_pairs=True)
        assert is_pairs(packed.panels) and torch.equal(unpack_weight(packed, 37), w.float())
    assert not is_pairs(pack_weight(w.float()).panels)  # the float32 model's bf16 kind
    # a quantized model's head is rounded to Q8_0 all the same
    assert pack_weight(torch.randn(32, 64).to(BF16), True, True).panels.dtype == torch.int8


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """A bf16 unit in the last place at each value's magnitude, float64."""
    exponent = torch.frexp(values.double().abs().clamp_min(2 ** -100))[1]
    return torch.ldexp(torch.ones_like(values, dtype=torch.float64), exponent - 8)


def assert_rounded_once(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None) -> None:
    """got is x W^T + bias summed in float32 and rounded to bf16: within one bf16 unit
    of the exact value plus what K float32 additions may lose (K * 2^-24 of the sum of
    the products' magnitudes), and equal to the exact value rounded nearly always."""
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    sums = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    slack = bf16_ulp(exact) + x.shape[1] * 2.0 ** -24 * sums
    assert ((got.double() - exact).abs() <= slack).all()
    assert (got == exact.to(BF16)).float().mean() > 0.9


@needs_pairs
@pytest.mark.parametrize("rows,n,k", [(1, 48, 64), (2, 17, 6), (5, 100, 576),
                                      (6, 33, 4098), (13, 40, 2050), (64, 300, 96),
                                      (130, 65, 1536)])
def test_the_product_is_the_exact_one_rounded_to_bf16(kernel, rows, n, k):
    """Every row count the micro-kernels take (1-6 and blocks of them; AMX's tiles of
    16 rows, a last one padded), ragged panels (n not a multiple of 16), K past a slab
    of 2,048 inputs (sums carried) and not a multiple of 32 (AMX's last pairs on
    AVX512-BF16) or under 32 (none on AMX); with and without a bias."""
    gen = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=gen).to(BF16)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    panels = pack_bf16_pairs(w)
    for b in (None, bias):
        got = torch.ops.kvserve.bf16_linear_on(x, panels, n, b, kernel)
        assert got.dtype == BF16 and got.shape == (rows, n) and got.is_contiguous()
        assert_rounded_once(got, x, w, b)
    # a 3-D input through the wrapper, and no rows at all
    assert torch.equal(bf16_linear(x.view(1, rows, k), panels, n, bias)[0],
                       bf16_linear(x, panels, n, bias))
    assert bf16_linear(x[:0], panels, n, None).shape == (0, n)


@needs_pairs
@pytest.mark.parametrize("rows,n,k", [(1, 1000, 96), (7, 1030, 2050), (3, 4000, 64),
                                      (40, 2000, 64)])
def test_wide_layers_whichever_thread_takes_a_chunk_the_same_product(kernel, rows, n, k):
    """Wide layers (at least 4 chunks of 8 panels a thread) are shared out a chunk at
    a time to whichever thread is free: the same bits as one thread's, and the exact
    product rounded once; the last chunk's panels left over in tiles of 4, 2 and 1."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(BF16)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    panels = pack_bf16_pairs(w)
    got = {}
    for t in (1, 2, 3):
        with torch_threads(t):
            got[t] = torch.ops.kvserve.bf16_linear_on(x, panels, n, bias, kernel)
    assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[3])
    assert_rounded_once(got[2], x, w, bias)


@needs_pairs
@pytest.mark.parametrize("k", [576, 2050])
def test_a_rows_product_is_the_same_whatever_shares_its_call(kernel, k):
    """A row's bits depend on neither how many rows come with it nor where it sits
    among them (one row, AMX's 16-row tiles, whole and padded, 32-row blocks, the
    AVX512 kernel's blocks of 6): a request's tokens do not change with the batch."""
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(200, k, generator=gen).to(BF16)
    x = torch.randn(70, k, generator=gen).to(BF16)
    panels = pack_bf16_pairs(w)
    alone = torch.cat([torch.ops.kvserve.bf16_linear_on(x[i:i + 1], panels, 200, None, kernel)
                       for i in range(70)])
    for rows in (5, 16, 17, 33, 70):
        together = torch.ops.kvserve.bf16_linear_on(x[:rows], panels, 200, None, kernel)
        assert torch.equal(together, alone[:rows]), rows
    shifted = torch.ops.kvserve.bf16_linear_on(x[3:40], panels, 200, None, kernel)
    assert torch.equal(shifted, alone[3:40])


@needs_pairs
def test_bf16_linear_takes_amx_wherever_the_cpu_has_it(kernels):
    """The op's own choice: AMX's tiles for every row count where the CPU has them
    (bits equal to naming "amx"), AVX512-BF16 elsewhere; an unknown kernel refused."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen).to(BF16)
    panels = pack_bf16_pairs(w)
    chosen = "amx" if amx_here() else "avx512"
    for rows in (1, 16, 40):
        x = torch.randn(rows, 256, generator=gen).to(BF16)
        assert torch.equal(torch.ops.kvserve.bf16_linear(x, panels, 64, None),
                           torch.ops.kvserve.bf16_linear_on(x, panels, 64, None, chosen))
    with pytest.raises(RuntimeError, match="kernel must be avx512 or amx"):
        torch.ops.kvserve.bf16_linear_on(x, panels, 64, None, "sse")


@needs_pairs
def test_bad_inputs_are_refused(kernels):
    w = torch.randn(32, 64).to(BF16)
    panels = pack_bf16_pairs(w)
    op = torch.ops.kvserve.bf16_linear
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        op(torch.randn(2, 64), panels, 32, None)
    with pytest.raises(RuntimeError, match="not bf16 pair panels for 62 inputs"):
        op(torch.randn(2, 62).to(BF16), panels, 32, None)
    with pytest.raises(RuntimeError, match="not bf16 pair panels"):
        op(torch.randn(2, 64).to(BF16), panels, 33, None)  # more outputs than panels
    with pytest.raises(RuntimeError, match="the bias must be 32 bfloat16 values"):
        op(torch.randn(2, 64).to(BF16), panels, 32, torch.zeros(32))


def test_bf16_models_pack_their_float_layers_where_the_cpu_multiplies_pairs():
    assert packing_wanted("auto", CPU, BF16, PAIRS)
    assert packing_wanted("kvserve", CPU, BF16, PAIRS)
    assert not packing_wanted("auto", CPU, BF16, AVX2 | {"avx512f", "avx512bw"})
    assert not packing_wanted("torch", CPU, BF16, PAIRS)
    assert not packing_wanted("auto", torch.device("cuda"), BF16, PAIRS)
    assert not packing_wanted("auto", CPU, torch.float16, PAIRS)
    assert not packing_wanted("auto", CPU, torch.float32, PAIRS)  # oneDNN's float32
    with pytest.raises(ModelLoadError, match="avx512_bf16 for bfloat16"):
        packing_wanted("kvserve", CPU, BF16, AVX2 | {"avx512f", "avx512bw", "avx512dq"})
    with pytest.raises(ModelLoadError, match="runs float32 or bfloat16 on CPU"):
        packing_wanted("kvserve", CPU, torch.float16, PAIRS)


@pytest.fixture(scope="module")
def tied_model():
    """load(path) -> (a bf16 model, its config), loaded afresh each call."""
    from kvserve.engine.config.model_config import ModelConfig
    from kvserve.engine.weights.loader import load_model

    def load(path):
        cfg = ModelConfig.from_pretrained(str(path))
        return load_model(path, cfg, BF16, CPU, 256), cfg

    return load


@needs_pairs
def test_a_bf16_model_on_pairs_computes_onednns_outputs(kernels, tied_model, tmp_path):
    """Every Linear packed in pairs, the tied embedding reading the head's panels (one
    table), and the logits of a few positions oneDNN's within bf16's rounding."""
    from tests.support.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True, dtype=BF16)
    packed_model, cfg = tied_model(path)
    plain, _ = tied_model(path)
    linears = [m for m in packed_model.modules() if isinstance(m, Linear)]
    assert pack_model(packed_model, "auto", CPU, BF16, PAIRS) == len(linears)
    assert all(m.weight is None and is_pairs(m.packed.panels) for m in linears)
    assert packed_model.embed_tokens.packed is packed_model.lm_head.packed
    ids = torch.tensor([1, 5, 9, 17, 33, 2, 7])
    with torch.inference_mode():
        assert torch.equal(packed_model.embed_tokens(ids), plain.embed_tokens(ids))
        x = torch.randn(5, cfg.hidden_size).to(BF16)
        torch.testing.assert_close(packed_model.compute_logits(x).float(),
                                   plain.compute_logits(x).float(), rtol=0.02, atol=0.02)
