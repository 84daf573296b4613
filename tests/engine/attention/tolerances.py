"""How close a kernel must come to the fp32 torch reference, per input dtype.

bf16: the kernels compute in fp32 but round the output to bf16 (the interpreter
truncates where the GPU rounds to nearest-even, and on the GPU the softmax weights
are rounded to bf16 before the P.V product), so allow two bf16 steps."""
from __future__ import annotations

import torch

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), "NaN in the output: a row not written, or poison read"
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[out.dtype])
