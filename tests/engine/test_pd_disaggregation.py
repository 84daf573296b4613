"""Prefill/decode disaggregation (engine/kv_transfer/): a prefill engine computes a
prompt's KV and holds its blocks; a decode engine handed the prefill's answer reads
them with Mooncake's transfer engine and computes only the tail. Greedy output is
token-identical to one engine doing both, and every block is back in both caches
once the transfer ends, whether it was read, failed or was never fetched."""
from __future__ import annotations

import os
import threading
import time

import pytest

from kvserve.engine.client.async_engine import _QueueSource
from kvserve.engine.client.engine_loop import EngineLoop
from kvserve.engine.client.messages import AbortRequest, AddRequest, Shutdown
from kvserve.engine.config.kv_transfer_config import KVTransferConfig
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO lines
pytest.importorskip("mooncake.engine", reason="the pd extra (Mooncake, libibverbs1) is "
                    "not installed", exc_type=ImportError)

BLOCK = 16


class Instance:
    """An engine on its loop's thread, as a server runs it, minus HTTP."""

    def __init__(self, engine):
        self.engine, self.source = engine, _QueueSource()
        self.outputs: dict[str, list] = {}
        self.cond = threading.Condition()
        self.loop = EngineLoop(engine, self.source, self._report)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def _report(self, rep):
        with self.cond:
            for out in rep.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
            self.cond.notify_all()

    def send(self, command):
        self.source.queue.put(command)

    def result(self, request_id, timeout=60.0):
        """The request's tokens and its finishing output."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not any(o.finished for o in self.outputs.get(request_id, ())):
                assert self.cond.wait(deadline - time.monotonic()), request_id
            outs = self.outputs[request_id]
        return [t for o in outs for t in o.new_token_ids], outs[-1]

    def generate(self, request_id, prompt, params):
        self.send(AddRequest(request_id, prompt, params))
        return self.result(request_id)

    def stop(self):
        self.send(Shutdown())
        self.thread.join(10)


def greedy(n, handoff=None):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                          kv_transfer_params=handoff)


def idle(instance, timeout=10.0):
    """Waits until the engine holds no block (pins included)."""
    kv = instance.engine.scheduler.kv
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kv.num_free_blocks == kv.num_blocks and not instance.engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pd(tiny_engine_factory):
    made = []

    def make(role, **overrides):
        config = KVTransferConfig(kv_role=role, kv_connector_extra_config=overrides.pop(
            "extra", {}))
        inst = Instance(tiny_engine_factory(kv_transfer_config=config, **overrides))
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.stop()


def prefill_then_decode(prefill, decode, rid, prompt, n):
    _, first = prefill.generate(rid, prompt, greedy(1, {"do_remote_decode": True}))
    handoff = first.kv_transfer_params
    assert handoff is not None and handoff["do_remote_prefill"]
    return decode.generate(rid, prompt, greedy(n, handoff)), handoff


@pytest.mark.parametrize("compile", ["off", "wait"])
def test_decode_reads_the_prefills_blocks_and_matches_one_engine(pd, tiny_engine_factory,
                                                                 compile):
    prompts = varied_prompts(400, 4, seed=71, lengths=(150, 97, 40, 130))
    want = tiny_engine_factory().generate(prompts, greedy(60))
    # the prefill in 48-token chunks; the decode with room for one or two of the
    # four at once, so some are preempted and computed again
    prefill = pd("kv_producer", max_num_batched_tokens=48)
    decode = pd("kv_consumer", num_kv_blocks=20, compile=compile)
    handoffs = []
    for i, prompt in enumerate(prompts):
        _, first = prefill.generate(f"r{i}", prompt, greedy(1, {"do_remote_decode": True}))
        handoffs.append(first.kv_transfer_params)
        assert len(handoffs[-1]["remote_block_ids"]) == (len(prompt) - 1) // BLOCK
    for i, prompt in enumerate(prompts):  # all at once
        decode.send(AddRequest(f"r{i}", prompt, greedy(60, handoffs[i])))
    for i, prompt in enumerate(prompts):
        tokens, last = decode.result(f"r{i}")
        assert tokens == want[i], i
    consumer = decode.loop.kv_transfer.consumer
    assert consumer.stats.done == 4 and consumer.stats.failed == 0
    assert consumer.stats.blocks == sum((len(p) - 1) // BLOCK for p in prompts)
    assert decode.engine.stats().num_preemptions > 0
    assert idle(prefill) and idle(decode)  # pins released on both sides


def test_only_the_tail_is_computed(pd):
    prompt = varied_prompts(400, 1, seed=70, lengths=(150,))[0]
    prefill, decode = pd("kv_producer"), pd("kv_consumer")
    before = decode.engine.stats().prompt_tokens_computed
    (_, last), handoff = prefill_then_decode(prefill, decode, "t", prompt, 8)
    usable = (len(prompt) - 1) // BLOCK * BLOCK
    assert last.num_cached_tokens == usable
    assert decode.engine.stats().prompt_tokens_computed - before == len(prompt) - usable


def test_blocks_the_decode_has_cached_are_not_read_again(pd, tiny_engine_factory):
    shared = varied_prompts(400, 1, seed=72, lengths=(96,))[0]
    a, b = (shared + p for p in varied_prompts(400, 2, seed=73, lengths=(40, 50)))
    want = tiny_engine_factory().generate([a, b], greedy(4))
    prefill, decode = pd("kv_producer"), pd("kv_consumer")
    assert prefill_then_decode(prefill, decode, "a", a, 4)[0][0] == want[0]
    blocks = decode.loop.kv_transfer.consumer.stats.blocks
    assert prefill_then_decode(prefill, decode, "b", b, 4)[0][0] == want[1]
    # b's shared 96 tokens (6 blocks) are in the decode's cache from a's turn
    assert decode.loop.kv_transfer.consumer.stats.blocks - blocks == (len(b) - 1) // BLOCK - 6


def test_a_dead_prefill_means_a_recompute(pd, tiny_engine_factory):
    prompt = varied_prompts(400, 1, seed=74, lengths=(120,))[0]
    want = tiny_engine_factory().generate([prompt], greedy(12))[0]
    decode = pd("kv_consumer", extra={"fetch_timeout_s": 0.5})
    handoff = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
               "transfer_id": "0" * 32}
    tokens, last = decode.generate("x", prompt, greedy(12, handoff))
    assert tokens == want and last.num_cached_tokens == 0
    assert decode.loop.kv_transfer.consumer.stats.failed == 1
    assert idle(decode)


def test_a_hold_nobody_fetches_expires_and_unpins(pd):
    prompt = varied_prompts(400, 1, seed=75, lengths=(80,))[0]
    prefill = pd("kv_producer", extra={"hold_timeout_s": 0.3})
    _, first = prefill.generate("p", prompt, greedy(1, {"do_remote_decode": True}))
    assert first.kv_transfer_params["remote_block_ids"]
    kv = prefill.engine.scheduler.kv
    assert kv.num_free_blocks < kv.num_blocks  # pinned for the decode instance
    assert idle(prefill, timeout=5.0)
    assert prefill.loop.kv_transfer.producer.expired == 1


def test_an_abort_while_fetching_ends_the_request(pd):
    prompt = varied_prompts(400, 1, seed=76, lengths=(60,))[0]
    # a side channel that never answers: the fetch waits its timeout out
    decode = pd("kv_consumer", extra={"fetch_timeout_s": 5.0})
    import zmq
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        handoff = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                   "remote_port": port, "transfer_id": "1" * 32}
        decode.send(AddRequest("y", prompt, greedy(8, handoff)))
        time.sleep(0.2)
        decode.send(AbortRequest("y"))
        tokens, last = decode.result("y", timeout=3.0)
        assert last.finish_reason == "abort" and tokens == []
    finally:
        silent.close(0)
    assert idle(decode)


def test_a_prefill_aborted_holds_nothing(pd):
    prompt = varied_prompts(400, 1, seed=77, lengths=(200,))[0]
    prefill = pd("kv_producer", max_num_batched_tokens=32)  # several chunks: time to abort
    prefill.send(AddRequest("q", prompt, greedy(1, {"do_remote_decode": True})))
    prefill.send(AbortRequest("q"))
    _, last = prefill.result("q")
    assert last.finish_reason == "abort" and last.kv_transfer_params is None
    assert idle(prefill) and not prefill.loop.kv_transfer.producer.pending


def test_holds_take_at_most_half_the_cache(pd, tiny_engine_factory):
    """Callers that ask for do_remote_decode and never fetch cannot pin the cache
    the prefill's own requests need: past half of it, a prompt is handed off
    without its KV, and the decode instance computes it."""
    prompts = varied_prompts(400, 3, seed=78, lengths=(150, 150, 150))
    want = tiny_engine_factory().generate(prompts[2:], greedy(6))[0]
    prefill = pd("kv_producer", num_kv_blocks=40, extra={"hold_timeout_s": 1.0})
    decode = pd("kv_consumer")
    handoffs = [prefill.generate(f"h{i}", p, greedy(1, {"do_remote_decode": True}))[1]
                .kv_transfer_params for i, p in enumerate(prompts)]
    assert [len(h["remote_block_ids"]) for h in handoffs] == [9, 9, 0]  # 18 of 20 held
    assert handoffs[2]["transfer_id"] is None
    assert prefill.loop.kv_transfer.producer.refused == 1
    tokens, last = decode.generate("h2", prompts[2], greedy(6, handoffs[2]))
    assert tokens == want and last.num_cached_tokens == 0
    consumer = decode.loop.kv_transfer.consumer
    assert consumer.stats.done == consumer.stats.failed == 0  # nothing was fetched
    assert idle(prefill) and idle(decode)
