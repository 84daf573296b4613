"""bench/direct_call_ab.py on the tiny model: both ways are timed, the machine said."""
import json

from bench.direct_call_ab import main


def test_both_ways_are_timed_and_the_machine_recorded(tiny_model_dir, capsys):
    assert main(["--model", str(tiny_model_dir("llama")), "--prompt-len", "8",
                 "--steps", "6"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["direct_step_ms"] > 0 and result["dynamo_step_ms"] > 0
    assert result["direct_p25_ms"] > 0 and result["dynamo_p25_ms"] > 0
    assert isinstance(result["cpu_flags"], list)
