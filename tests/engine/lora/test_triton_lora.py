"""The LoRA Triton kernels (through Triton's CPU interpreter here, on the device in a
GPU session) against the torch reference: mixed slots, untouched rows, odd sizes,
zero-padded ranks, fp16."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.lora.batched import add_lora
from kvserve.engine.kernels.lora.triton_kernels import add_lora_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,fan_in,fan_out,rank", [(7, 24, 40, 8), (13, 200, 130, 16),
                                                        (1, 576, 192, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_the_torch_reference(tokens, fan_in, fan_out, rank, dtype):
    torch.manual_seed(tokens)
    a = torch.randn(3, rank, fan_in, device=DEVICE).to(dtype) / fan_in ** 0.5
    b = torch.randn(3, rank, fan_out, device=DEVICE).to(dtype)
    a[2, rank // 2:] = 0  # a smaller adapter in a zero-padded slot
    b[2, rank // 2:] = 0
    x = torch.randn(tokens, fan_in, device=DEVICE).to(dtype)
    y = torch.randn(tokens, fan_out, device=DEVICE).to(dtype)
    slots = torch.randint(-1, 3, (tokens,), device=DEVICE)
    slots[0] = -1
    want = add_lora(y.float().clone(), x.float(), a.float(), b.float(), slots)
    got = add_lora_triton(y.clone(), x, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[slots < 0], y[slots < 0])  # no adapter: untouched


def test_no_adapter_anywhere_changes_nothing():
    x, y = torch.randn(4, 16, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    a, b = torch.randn(2, 4, 16, device=DEVICE), torch.randn(2, 4, 8, device=DEVICE)
    out = add_lora_triton(y.clone(), x, a, b, torch.full((4,), -1, device=DEVICE))
    assert torch.equal(out, y)
