"""LoRA in the scheduler: requests of at most max_loras adapters run at once (the
others step aside, keeping their place, for the requests behind them; the base
model is never held back), and the prefix cache is keyed by adapter."""
from __future__ import annotations

from kvserve.kvcache import KVCacheManager
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from tests.scheduler.test_scheduler_unit import assert_empty, make, run_all, step


def lora_req(rid: str, lora: str | None, prompt: list[int] | None = None,
             max_tokens: int = 4) -> Request:
    return Request(rid, prompt or [hash(rid) % 1000 + i for i in range(6)],
                   SamplingParams(max_tokens=max_tokens), lora=lora)


def test_at_most_max_loras_adapters_run_and_the_rest_keep_their_place():
    s = make(max_loras=1)
    for r in [lora_req("a1", "a"), lora_req("b1", "b"), lora_req("base", None),
              lora_req("a2", "a"), lora_req("b2", "b")]:
        s.add_request(r)
    out, _ = step(s)
    assert [x[0] for x in out.plan] == ["a1", "base", "a2"]
    assert [r.request_id for r in s.waiting] == ["b1", "b2"]  # order kept
    run_all(s)
    assert_empty(s)


def test_adapters_run_side_by_side_up_to_the_limit():
    s = make(max_loras=2)
    for r in [lora_req("a", "a"), lora_req("b", "b"), lora_req("c", "c"), lora_req("a2", "a")]:
        s.add_request(r)
    out, _ = step(s)
    assert [x[0] for x in out.plan] == ["a", "b", "a2"]
    while "c" not in {r.request_id for r in s.running}:
        step(s)
        assert len({r.lora for r in s.running}) <= 2
    run_all(s)
    assert_empty(s)


def test_without_lora_no_request_is_held_back():
    s = make()  # max_loras 0: LoRA off
    for i in range(4):
        s.add_request(lora_req(f"r{i}", f"x{i}"))
    out, _ = step(s)
    assert len(out.plan) == 4


def test_the_prefix_cache_is_keyed_by_adapter():
    kv = KVCacheManager(32, 4)
    prompt = list(range(100, 117))
    assert kv.lookup_prefix("a", prompt, adapter="a@1") == 0
    assert kv.allocate_slots("a", prompt, 0, len(prompt))
    kv.free("a")  # its full blocks stay cached under adapter a@1
    assert kv.lookup_prefix("same", prompt, adapter="a@1") == 16
    for other in (None, "a@2", "b@1"):
        assert kv.lookup_prefix(f"x{other}", prompt, adapter=other) == 0, other
