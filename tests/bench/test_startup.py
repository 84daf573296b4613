"""bench/startup.py's arithmetic (the servers themselves are started only by the
benchmark): the summary's ratios and targets, and its report."""
from __future__ import annotations

from bench.startup import TARGETS, markdown, summarise


def _result() -> dict:
    return {"eager": {"command": "kvserve serve --compile off", "health_s": 15.0,
                      "idle_eager_answer_s": 0.8},
            "cold": {"command": "kvserve serve", "health_s": 58.0, "first_answer_s": 79.4,
                     "ready_s": 271.2, "compiled_answer_s": 0.25,
                     "probes_while_compiling": [[58.2, 21.2], [79.4, 1.1]]},
            "warm": {"command": "kvserve serve", "health_s": 14.6, "first_answer_s": 15.0,
                     "ready_s": 19.5, "compiled_answer_s": 0.2,
                     "probes_while_compiling": [[14.7, 0.4], [17.7, 1.2]]}}


def test_the_summary_takes_the_worst_probe_over_the_idle_eager_answer():
    s = summarise(_result())
    assert s["warm_to_compiled_s"] == 19.5 and s["cold_first_answer_s"] == 79.4
    assert s["compiling_over_idle_eager"] == round(21.2 / 0.8, 2)
    assert s["compiling_median_over_idle_eager"] == round(1.15 / 0.8, 2)
    assert s["met"] == {"warm_to_compiled_s": True, "cold_first_answer_s": False,
                        "compiling_over_idle_eager": False}
    assert set(s["met"]) == set(TARGETS)


def test_a_phase_left_out_is_left_out_of_the_summary():
    result = _result()
    del result["cold"], result["eager"]
    s = summarise(result)
    assert set(s) == {"warm_to_compiled_s", "met"} and s["met"] == {"warm_to_compiled_s": True}


def test_the_report_names_the_machine_and_every_phase():
    result = {**_result(), "date": "2026-11-29 01:16", "commit": "abc1234",
              "command": "python bench/startup.py --out x", "loadavg": "0.1 0.1 0.1",
              "machine": {"cpu": "AMD EPYC", "cores": 2, "simd_flags": ["avx2", "avx512f"]}}
    result["summary"] = summarise(result)
    text = markdown(result)
    assert "AMD EPYC, 2 cores, flags avx2 avx512f" in text
    assert "| warm_to_compiled_s | 19.5 | 20.0 met |" in text
    assert "| cold_first_answer_s | 79.4 | 45.0 missed |" in text
    assert all(f"## {phase}" in text for phase in ("eager", "cold", "warm"))
    assert "probes (sent at s: took s): 58.2: 21.2, 79.4: 1.1" in text
