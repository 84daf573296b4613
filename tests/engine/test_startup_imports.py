"""What the front end imports before it spawns its engine process stays light: every
second of it delays the child's own imports and load (a warm start's critical path).
Dynamo (~1.1 s on a 2-core AVX2 EPYC) is the engine's to import, not the server's."""
from __future__ import annotations

import subprocess
import sys

import torch

from kvserve.engine.kernels.moe import fused_experts

# The modules server/entrypoints/cli.py's build_server_app imports before start_engine.
BEFORE_SPAWN = ("kvserve.engine.kernels.attention", "kvserve.engine.config.model_config",
                "kvserve.engine.client.launch", "kvserve.engine.weights.cpu_packing",
                "kvserve.engine.weights.loader", "kvserve.engine.client.process_engine",
                "kvserve.server.entrypoints.app")


def test_the_front_end_imports_no_dynamo_before_the_spawn():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in BEFORE_SPAWN)
            + "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_bf16_dots_is_marked_as_dynamos_decorator_marks():
    def probe():
        return True

    marked = torch._dynamo.assume_constant_result(probe)
    assert marked is probe and vars(probe) == {"_dynamo_marked_constant": True}
    assert {k: v for k, v in vars(fused_experts._bf16_dots).items()
            if k.startswith("_dynamo")} == vars(probe)
