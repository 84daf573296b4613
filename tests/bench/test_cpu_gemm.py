"""bench/cpu_gemm.py on a small model shape: every way it times computes the same
product (checked inside the benchmark against a float64 one), every row count and
way is reported, and the report says which machine it ran on."""
import json

import pytest

from bench.cpu_gemm import WAYS, main
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS

pytestmark = pytest.mark.skipif(not set(NEEDED_FLAGS) <= cpu_flags(),
                                reason="kvserve's CPU kernels need AVX2, FMA and F16C")


def test_every_way_and_row_count_is_timed_and_the_machine_recorded(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert main(["--shape", "64,96,64,32,256,2", "--rows", "1,7", "--rounds", "1",
                 "--layers", "1", "--copy-mib", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == [64, 96, 64, 32, 256, 2]
    assert result["capability"] and "avx2" in result["cpu_flags"]
    assert {(c["rows"], c["way"]) for c in result["cases"]} == {
        (rows, way) for rows in (1, 7) for way in WAYS}
    assert all(c["step_ms"] > 0 and c["gflops"] > 0 for c in result["cases"])
    assert "| 7 |" in capsys.readouterr().out
