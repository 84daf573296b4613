"""The typed messages between the server and the engine loop (engine/client/messages.py):
what the client sends for a request's life, and that they cross a process pipe."""
from __future__ import annotations

import asyncio
import pickle

import pytest

from kvserve.engine.client.engine_client import EngineClient
from kvserve.engine.client.engine_loop import EngineLoop
from kvserve.engine.client.messages import (AbortRequest, AddRequest, EngineDied, EngineReady,
                                            Shutdown, StepReport, TakeSnapshot)
from kvserve.engine.core.reports import EngineInfo
from kvserve.engine.platform.outputs import RequestOutput
from kvserve.scheduler.sampling_params import SamplingParams


class RecordingClient(EngineClient):
    """An engine client whose transport only records what it is asked to send."""

    def __init__(self):
        super().__init__(None, EngineInfo(max_model_len=64, vocab_size=100,
                                          structured_backend="xgrammar"))
        self.sent: list = []

    def start(self) -> None:
        pass

    def shutdown(self, timeout: float = 5.0) -> None:
        pass

    @property
    def is_alive(self) -> bool:
        return True

    def _submit(self, command) -> None:
        self.sent.append(command)


def test_every_message_crosses_a_pipe_unchanged():
    params = SamplingParams(max_tokens=3, n=2, seed=1)
    report = StepReport(outputs=[RequestOutput("r", 1, [5], True, "length")], added=1)
    ready = EngineReady(EngineInfo(max_model_len=64, vocab_size=100, structured_backend="xgrammar",
                                   shorter_embeddings=(32, 16), adapters={"a": "/x"}, max_loras=2))
    for message in (AddRequest("r", [1, 2], params, "salt", 2), AbortRequest("r", 1, "stop"),
                    Shutdown(), report, ready, EngineDied("rank 1 exited")):
        assert pickle.loads(pickle.dumps(message)) == message


def test_the_engine_describes_itself_and_its_counters_in_typed_records(tiny_engine_factory):
    """What a client is built from (EngineInfo) and what the loop reports from
    (EngineStats): the engine's own records, no reaching into its parts."""
    engine = tiny_engine_factory("llama")
    info = engine.info()
    assert (info.max_model_len, info.vocab_size) == (engine.max_model_len,
                                                     engine.model_config.vocab_size)
    assert info.adapters is None and info.max_loras == 0
    client = RecordingClient.__new__(RecordingClient)
    EngineClient.__init__(client, None, info)
    assert (client.max_model_len, client.vocab_size) == (info.max_model_len, info.vocab_size)
    before = engine.stats()
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0))
    after = engine.stats()
    assert after.steps - before.steps >= 4
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 5
    assert after.generated_tokens - before.generated_tokens == 4
    assert (after.num_waiting, after.num_running, after.kv_usage) == (0, 0, 0.0)
    assert pickle.loads(pickle.dumps(after)) == after


def test_a_request_is_one_add_and_leaving_early_one_abort_for_all_its_sequences():
    client = RecordingClient()
    params = SamplingParams(max_tokens=4, n=3)

    async def run():
        gen = client.generate("req-1", [1, 2, 3], params)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        client._on_report(StepReport(outputs=[RequestOutput("req-1", 2, [7])], added=1))
        out = await first
        await gen.aclose()  # the client leaves with three sequences unfinished
        return out

    out = asyncio.run(run())
    assert (out.request_id, out.index, out.new_token_ids) == ("req-1", 2, [7])
    assert client.sent == [AddRequest("req-1", [1, 2, 3], params), AbortRequest("req-1")]


def test_a_finished_request_sends_no_abort():
    client = RecordingClient()

    async def run():
        gen = client.generate("r", [1], SamplingParams(max_tokens=1, n=2))
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        client._on_report(StepReport(outputs=[RequestOutput("r", i, [3], True, "length")
                                              for i in (0, 1)]))
        return [await pending] + [o async for o in gen]

    assert [o.index for o in asyncio.run(run())] == [0, 1]
    assert [type(m) for m in client.sent] == [AddRequest]


def test_the_loop_refuses_what_is_not_a_command(tiny_engine_factory):
    loop = EngineLoop(tiny_engine_factory(), commands=None, report=None)
    with pytest.raises(TypeError, match="not an engine command"):
        loop._handle(("abort", ("r", "abort")), StepReport())  # the old tuple form


class _Commands:
    """Hands the loop each batch of commands in turn, then Shutdown."""

    def __init__(self, *batches):
        self.batches = list(batches)

    def take(self, wait):
        return self.batches.pop(0) if self.batches else [Shutdown()]


def test_a_snapshot_is_built_only_when_asked_and_crosses_a_pipe(tiny_engine_factory,
                                                                 monkeypatch):
    engine = tiny_engine_factory()
    built = []
    real = type(engine.scheduler).snapshot
    monkeypatch.setattr(type(engine.scheduler), "snapshot",
                        lambda self: built.append(1) or real(self))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reports = []
    loop = EngineLoop(engine, _Commands([AddRequest("r", [1, 2, 3], params)], [], [],
                                        [TakeSnapshot()], []), reports.append)
    loop.run()
    assert [r.snapshot is not None for r in reports] == [False, False, False, True, False,
                                                          False]
    assert built == [1]  # never per step: only the step that was asked
    snap = reports[3].snapshot
    assert [(v.request_id, v.phase) for v in snap.scheduler.requests] == [("r", "decode")]
    assert not snap.speculative
    assert pickle.loads(pickle.dumps(reports[3])) == reports[3]
