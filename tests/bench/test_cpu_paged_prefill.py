"""bench/cpu_paged_prefill.py on a short chunk: it times both ways and says on which CPU."""
import json

import pytest

from bench.cpu_paged_prefill import main
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS

pytestmark = pytest.mark.skipif(not set(NEEDED_FLAGS) <= cpu_flags(),
                                reason="kvserve's CPU kernels need AVX2, FMA and F16C")


def test_a_chunk_is_timed_both_ways_and_the_machine_recorded(capsys):
    assert main(["--chunk", "20", "--context", "50", "--steps", "2", "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chunk"] == 20 and result["context"] == 50
    assert result["step_ms"] > 0 and result["gather_sdpa_step_ms"] > 0
    assert result["kernel_speedup"] == pytest.approx(
        result["gather_sdpa_step_ms"] / result["step_ms"], rel=0.02)
    assert "avx2" in result["cpu_flags"]


def test_a_chunk_longer_than_its_context_is_refused():
    with pytest.raises(SystemExit):
        main(["--chunk", "60", "--context", "50"])
