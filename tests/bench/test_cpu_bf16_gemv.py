"""bench/cpu_bf16_gemv.py on a small weight: every way it times computes the same
product (checked inside the benchmark against torch's fp32 linear), and the report
says which machine it ran on."""
import json

from bench.cpu_bf16_gemv import main


def test_every_way_computes_the_same_product_and_the_machine_is_recorded(tmp_path, capsys):
    out = tmp_path / "gemv.json"
    assert main(["--shape", "96", "64", "--repeats", "1", "--copy-mib", "8",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weight"] == [96, 64]
    assert result["capability"] and isinstance(result["cpu_flags"], list)
    assert {(c["rows"], c["weights"]) for c in result["cases"]} == {
        (1, "fp32"), (1, "bf16"), (16, "fp32"), (16, "bf16")}
    assert len(result["cases"]) == 8 and all(c["ms"] > 0 for c in result["cases"])
    assert "| 16 | bf16 | torch bf16 linear |" in capsys.readouterr().out
