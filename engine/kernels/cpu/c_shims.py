"""The C entry points the CPU library gives its ops (extern "C" aoti_torch_cpu_<op>,
defined beside each op), for AOTInductor's C++ wrappers to call directly: Inductor's
`aot_inductor.custom_ops_to_c_shims`, given to the graph packages' builds
(engine/runner/graph_packages.py). Without them a package calls a custom op through
its proxy executor, a boxed call through the dispatcher: 1.60 against 1.32 us a call
of a tiny product (121 calls a default-model decode step, ~0.03 ms). The library is
loaded with its symbols global (build.py) so that a package's library finds them when
it is loaded."""
from __future__ import annotations

import torch

# op -> the declaration of its entry point, in AOTInductor's C shim convention: a
# tensor is an AtenTensorHandle, an optional one a pointer to one (null: None), the
# result a pointer to the handle it returns.
DECLARATIONS = {
    "bf16_linear": "AOTITorchError aoti_torch_cpu_bf16_linear(AtenTensorHandle x, "
                   "AtenTensorHandle weight, int64_t n, AtenTensorHandle* bias, "
                   "AtenTensorHandle* ret0)",
}


def c_shims() -> dict:
    """Inductor's custom_ops_to_c_shims for the library's ops, where it is loaded."""
    return {getattr(torch.ops.kvserve, op).default: [decl]
            for op, decl in DECLARATIONS.items() if hasattr(torch.ops.kvserve, op)}
