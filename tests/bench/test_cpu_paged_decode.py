"""bench/cpu_paged_decode.py on a short context: it times the op and says on which CPU."""
import json

import pytest

from bench.cpu_paged_decode import main
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS

pytestmark = pytest.mark.skipif(not set(NEEDED_FLAGS) <= cpu_flags(),
                                reason="kvserve's CPU kernels need AVX2, FMA and F16C")


def test_a_step_is_timed_and_the_machine_recorded(capsys):
    assert main(["--batch", "2", "--context", "40", "--steps", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batch"] == 2 and result["context"] == 40
    assert result["step_ms"] > 0 and result["kv_gb_s"] > 0
    assert "avx2" in result["cpu_flags"] and result["dtype"] == "float32"


def test_bf16_against_inductor_times_both_in_turns(capsys):
    assert main(["--dtype", "bfloat16", "--batch", "2", "--context", "40", "--steps", "2",
                 "--against-inductor"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "bfloat16" and result["inductor_step_ms"] > 0
    assert result["kernel_speedup"] == pytest.approx(
        result["inductor_step_ms"] / result["step_ms"], rel=0.02)
