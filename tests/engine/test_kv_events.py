"""KV cache events: a real ZMQ subscriber rebuilds the set of cached block hashes from
the events alone, and it equals the block pool's own after a random workload that
evicts, with the blocks' token ids or without them (include_token_ids false); the
messages are vLLM's (three frames, a msgpack EventBatch array of "type"-tagged event
maps). The events carry every tenant's tokens, so by default they are published on
loopback only."""
from __future__ import annotations

import logging
import random
import socket
import time

import msgpack
import pytest
import zmq

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.kv_events_config import KVEventsConfig, binds_every_interface
from kvserve.engine.core.engine import Engine
from kvserve.engine.core.kv_events import encode_event, external_hash, make_publisher
from kvserve.scheduler.kv_events import BlockStored
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.server import free_port


def apply(cached: set[int], ever: set[int], event: dict, token_ids: bool = True) -> None:
    """One event, as a router would apply it to its view of a replica (`ever`:
    every hash stored so far). vLLM 0.29's maps, exactly these keys; `token_ids`
    False: BlockStored's are left out (an empty list)."""
    kind = event["type"]
    if kind == "BlockStored":
        assert set(event) == {"type", "block_hashes", "parent_block_hash", "token_ids",
                              "block_size", "lora_id", "medium", "lora_name"}
        hashes, parent = event["block_hashes"], event["parent_block_hash"]
        assert event["block_size"] == 16
        sent = len(hashes) * 16 if token_ids else 0
        assert len(event["token_ids"]) == sent
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


def drain(sub: zmq.Socket, cached: set[int], seqs: list[int], quiet_s: float = 1.0,
          token_ids: bool = True) -> None:
    ever: set[int] = set()
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seqs.append(int.from_bytes(seq, "big"))
        ts, events = msgpack.unpackb(payload)
        assert isinstance(ts, float)
        for event in events:
            apply(cached, ever, event, token_ids)


@pytest.mark.parametrize("token_ids", [True, False], ids=["token-ids", "hashes-only"])
def test_a_subscriber_rebuilds_the_pools_hashes(tiny_model_dir, token_ids):
    """Hashes alone are enough to follow what a replica caches: a router that needs
    no more can have the tenants' tokens left out."""
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig.parse(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://127.0.0.1:{port}", "topic": "kv", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", '
        f'"include_token_ids": {str(token_ids).lower()}}}')
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
        drain(sub, cached, seqs, token_ids=token_ids)
        pool = engine.scheduler.kv._pool
        assert pool.cached, "the workload left nothing cached"
        assert engine.scheduler.kv.stats.evictions > 0, "the workload evicted nothing"
        assert cached == {external_hash(h) for h in pool.cached}
        assert seqs == list(range(len(seqs)))  # no gap: nothing dropped
        # A subscriber that missed everything asks the replay socket from sequence 0.
        assert replayed(f"tcp://127.0.0.1:{replay_port}", 0, token_ids) == cached
    finally:
        sub.close(0)
        engine.close()


def replayed(endpoint: str, start: int, token_ids: bool = True) -> set[int]:
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
                apply(cached, ever, event, token_ids)
    finally:
        dealer.close(0)


def test_the_flag_says_what_is_wrong(capsys):
    from kvserve.server.entrypoints.cli import build_parser

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
    # "false" as a string would be truthy: the ids would go out all the same.
    with pytest.raises(ValueError, match="include_token_ids must be true or false"):
        KVEventsConfig.parse('{"include_token_ids": "false"}')


def _outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_by_default_events_stay_on_loopback(caplog):
    """vLLM binds tcp://*:5557; kvserve binds loopback unless the operator names
    another endpoint, and then warns that every tenant's tokens go to who connects."""
    caplog.set_level(logging.WARNING, logger="kvserve.kv_events")
    default = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert default.endpoint == "tcp://127.0.0.1:5557"
    assert default.include_token_ids  # vllm-router's kv_aware indexes the ids
    # The default's host on a free port (5557 may be taken on a shared machine).
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=default.endpoint.replace(":5557", f":{port}"))
    publisher = make_publisher(config)
    try:
        assert _reachable("127.0.0.1", port)
        outward = _outward_address()
        if outward is not None:
            assert not _reachable(outward, port), f"published on {outward}"
    finally:
        publisher.close()
    assert "carry the token ids" not in caplog.text
    # An explicit wildcard still binds every interface, with a warning.
    port = free_port()
    publisher = make_publisher(KVEventsConfig(enable_kv_cache_events=True,
                                              publisher="zmq", endpoint=f"tcp://*:{port}"))
    try:
        outward = _outward_address()
        assert _reachable(outward or "127.0.0.1", port)
    finally:
        publisher.close()
    assert "carry the token ids of every tenant's prompts" in caplog.text


def test_which_endpoints_bind_every_interface():
    for endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"):
        assert binds_every_interface(endpoint), endpoint
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://10.0.0.5:5557", "ipc:///tmp/kv"):
        assert not binds_every_interface(endpoint), endpoint


def test_hashes_only_leaves_every_token_out():
    event = BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None,
                        token_ids=list(range(32)), block_size=16)
    assert encode_event(event)["token_ids"] == list(range(32))
    hashes_only = encode_event(event, token_ids=False)
    assert hashes_only["token_ids"] == []
    assert hashes_only["block_hashes"] == encode_event(event)["block_hashes"]


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
