"""bench/abuse.py against a tiny model served in this process, briefly: every
hostile request of its corpus is answered (none a 5xx), the normal streams go on,
and nothing is left running. Its timings (p99 ITL within 1.5x, /health under
100 ms) are the benchmark's to report, not a test's."""
from __future__ import annotations

from bench import abuse
from bench.abuse_corpus import CORPUS
from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.server import running_server


def test_every_attack_is_answered_without_a_5xx(tiny_engine_factory):
    config = ServerConfig(api_keys=list(abuse.KEYS[:2]), admin_api_keys=[abuse.KEYS[2]],
                          body_read_timeout=2.0)
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), ["tiny"], config=config)
    with running_server(app) as url:
        result = abuse.main(["--url", url, "--seconds", "8", "--rounds", "1",
                             "--streams", "2", "--attackers", "2"])
    assert result["five_xx"] == {} and result["stream_errors"] == []
    assert result["after"] == {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    answered = result["answers"]
    assert set(answered) <= set(CORPUS) and len(answered) >= 6
    assert answered["many_prompts_times_n"] == {"400": answered["many_prompts_times_n"]["400"]}
    assert all(r["tokens"] > 0 for r in result["rounds"])
    assert answered["slowloris_body"] == {"408": answered["slowloris_body"]["408"]}
    assert answered["thousands_of_tools"] == {"400": answered["thousands_of_tools"]["400"]}
    during = result["health_max_ms_during"]  # what /health waited on, by attack
    assert set(during) <= set(answered) and during and all(ms > 0 for ms in during.values())
