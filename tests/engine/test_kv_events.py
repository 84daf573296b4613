"""KV cache events: a real ZMQ subscriber rebuilds the set of cached block hashes from
the events alone, and it equals the block pool's own after a random workload that
evicts; the messages are vLLM's (three frames, a msgpack EventBatch array of
"type"-tagged event maps)."""
from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_events.config import KVEventsConfig
from engine.kv_events.publisher import external_hash
from scheduler.sampling_params import SamplingParams
from tests.support.server import free_port


def apply(cached: set[int], ever: set[int], event: dict) -> None:
    """One event, as a router would apply it to its view of a replica (`ever`:
    every hash stored so far). vLLM 0.29's maps, exactly these keys."""
    kind = event["type"]
    if kind == "BlockStored":
        assert set(event) == {"type", "block_hashes", "parent_block_hash", "token_ids",
                              "block_size", "lora_id", "medium", "lora_name"}
        hashes, parent = event["block_hashes"], event["parent_block_hash"]
        assert len(event["token_ids"]) == len(hashes) * event["block_size"] == len(hashes) * 16
        assert parent is None or parent in ever  # a chain continues a stored block
        assert (event["lora_id"], event["medium"]) == (None, "GPU")
        cached.update(hashes)
        ever.update(hashes)
    elif kind == "BlockRemoved":
        assert set(event) == {"type", "block_hashes", "medium"}
        assert set(event["block_hashes"]) <= cached, "removed a hash never stored"
        cached.difference_update(event["block_hashes"])
    elif kind == "AllBlocksCleared":
        cached.clear()
    else:
        raise AssertionError(f"unknown event {kind}")


def drain(sub: zmq.Socket, cached: set[int], seqs: list[int], quiet_s: float = 1.0) -> None:
    ever: set[int] = set()
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seqs.append(int.from_bytes(seq, "big"))
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        for event in events:
            apply(cached, ever, event)


def test_a_subscriber_rebuilds_the_pools_hashes(tiny_model_dir):
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig.parse(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://127.0.0.1:{port}", "topic": "kv", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}"}}')
    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=40,
                                 max_num_batched_tokens=64, compile="off",
                                 kv_events_config=config))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.5)  # PUB/SUB: a subscriber sees only what is sent after it joined
    cached: set[int] = set()
    seqs: list[int] = []
    rng = random.Random(0)
    stems = [[rng.randrange(1, 300) for _ in range(40)] for _ in range(4)]
    try:
        for round_ in range(6):  # shared stems hit; 40 blocks of 16 tokens evict
            prompts = [rng.choice(stems)[:rng.randrange(16, 40)]
                       + [rng.randrange(1, 300) for _ in range(rng.randrange(0, 40))]
                       for _ in range(6)]
            engine.generate(prompts, SamplingParams(max_tokens=rng.randrange(1, 24),
                                                    temperature=0.0, ignore_eos=True))
            engine.publish_kv_events()  # the engine loop does this every iteration
        drain(sub, cached, seqs)
        pool = engine.scheduler.kv._pool
        assert pool.cached, "the workload left nothing cached"
        assert engine.scheduler.kv.stats.evictions > 0, "the workload evicted nothing"
        assert cached == {external_hash(h) for h in pool.cached}
        assert seqs == list(range(len(seqs)))  # no gap: nothing dropped
        # A subscriber that missed everything asks the replay socket from sequence 0.
        assert replayed(f"tcp://127.0.0.1:{replay_port}", 0) == cached
    finally:
        sub.close(0)
        engine.close()


def replayed(endpoint: str, start: int) -> set[int]:
    """The cached set rebuilt from the batches the replay socket resends."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    cached: set[int] = set()
    ever: set[int] = set()
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert dealer.poll(5000), "the replay did not end"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return cached
            for event in msgpack.unpackb(payload)[1]:
                apply(cached, ever, event)
    finally:
        dealer.close(0)


def test_the_flag_says_what_is_wrong(capsys):
    from server.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-events-config", '{"endpiont": "x"}'])
    assert "unknown keys ['endpiont']" in capsys.readouterr().err


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpiont": "x"}')
    with pytest.raises(ValueError, match="publisher must be"):
        KVEventsConfig.parse('{"publisher": "kafka"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.parse("{enable")


def test_a_server_publishes_as_it_serves(tiny_model_dir, tmp_path):
    """The flag as `kvserve serve` takes it; the engine process's loop publishes."""
    import httpx

    from tests.server.test_ops_shutdown import serving

    port = free_port()
    flag = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://127.0.0.1:{port}", "topic": "kv"}}')
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")  # zmq reconnects until the server binds
    try:
        with serving(tiny_model_dir("llama"), tmp_path / "server.log",
                     "--kv-events-config", flag) as (_, url):
            time.sleep(0.5)
            prompt = "one two three four five six seven eight nine ten " * 4
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
            cached: set[int] = set()
            drain(sub, cached, [], quiet_s=2.0)
        assert cached  # the prompt's full blocks, stored
    finally:
        sub.close(0)
