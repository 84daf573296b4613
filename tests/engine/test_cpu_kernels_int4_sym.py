"""Symmetric int4 panels (GGUF's Q4_0, --quantization int4-sym: w = (q - 8) * scale)
keep no minimums; packed_gemm.cpp derives each as -8 * scale (int4_min). The sums
must be those of the same panels with -8 * scale stored, bit for bit, on every path
the op takes: one row (the batch-1 kernel), a few rows, many rows with integer
products, float rows widened in registers, bf16 rows widened for oneDNN, and the
AVX2 products a CPU without VNNI runs."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.cpu.packing import Packed, _group_panels, pack_int4, packed_linear
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import load_once
from tests.support.own_process import run_script_ok

needs_avx2 = pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(),
                                reason="the kernels need AVX2, FMA and F16C")
ROWS = (1, 2, 7, 13, 40, 130)


def both_forms(n: int, k: int, group: int, seed: int = 0) -> tuple[Packed, Packed]:
    """The same symmetric int4 weight packed without minimums and with -8 * scale
    stored as its minimums."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-4).half()
    symmetric = pack_int4(q, scales, -8 * scales)
    assert symmetric.mins is None  # found symmetric, so not kept
    stored = symmetric._replace(mins=_group_panels(-8 * scales))
    return symmetric, stored


def assert_same_sums(n: int, k: int, group: int) -> None:
    symmetric, stored = both_forms(n, k, group)
    assert symmetric.nbytes < stored.nbytes
    gen = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            for int8_inputs in (False, True):
                got = packed_linear(x.to(dtype), symmetric, n, None, int8_inputs)
                want = packed_linear(x.to(dtype), stored, n, None, int8_inputs)
                assert torch.equal(got, want), (rows, dtype, int8_inputs)


@pytest.fixture(scope="module")
def kernels():
    load_once()


@needs_avx2
@pytest.mark.parametrize("n,k,group", [(48, 96, 32), (80, 256, 128),
                                       (16, 64, 64)])
def test_symmetric_int4_sums_are_those_of_stored_minimums(kernels, n, k, group):
    assert_same_sums(n, k, group)


@needs_avx2
def test_symmetric_int4_without_vnni_too(kernels):
    script = (
        "from kvserve.engine.weights.cpu_packing import load_once\n"
        "from tests.engine.test_cpu_kernels_int4_sym import assert_same_sums\n"
        "load_once()\n"
        "assert_same_sums(48, 96, 32)\n"
        "assert_same_sums(32, 256, 128)\n"
        "print('ok')\n")
    run_script_ok(script, {"KVSERVE_NO_VNNI": "1"})


def test_only_minimums_of_minus_eight_scales_are_dropped():
    q = torch.zeros(16, 64, dtype=torch.uint8)
    scales = torch.full((2, 16), 0.5, dtype=torch.float16)
    near = -8 * scales
    near[1, 3] = -3.5  # one group off the symmetric grid: every minimum is kept
    assert pack_int4(q, scales, near).mins is not None
    assert pack_int4(q, scales, None).mins is None
