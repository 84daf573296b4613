"""Scheduler.snapshot(): what the engine page shows of the queues, each request's
phase and progress, and its block table."""
from __future__ import annotations

import pickle

from kvserve.scheduler.snapshot import MAX_WAITING_LISTED, SchedulerSnapshot
from tests.scheduler.test_scheduler_unit import make, req, step, three_full_blocks


def views(snap: SchedulerSnapshot) -> dict[str, tuple]:
    return {v.request_id: (v.phase, v.num_computed_tokens, v.num_tokens, len(v.block_ids))
            for v in snap.requests}


def test_a_chunked_prompt_is_in_prefill_until_its_last_chunk_then_decodes():
    s = make(max_num_batched_tokens=8)
    a, b = req("a", 20, max_tokens=4), req("b", 3)
    s.add_request(a)
    s.add_request(b)
    assert views(s.snapshot()) == {"a": ("waiting", 0, 20, 0), "b": ("waiting", 0, 3, 0)}
    step(s)  # 8 of a's 20 prompt tokens; b must wait for budget
    assert views(s.snapshot()) == {"a": ("prefill", 8, 20, 2), "b": ("waiting", 0, 3, 0)}
    step(s)
    step(s)  # a's last chunk samples its first token
    snap = s.snapshot()
    assert views(snap)["a"] == ("decode", 20, 21, 5)
    assert snap.requests[0].block_ids == tuple(s.kv.block_table("a"))
    assert snap.block_size == 4 and len(snap.block_states) == 64


def test_a_preempted_request_is_shown_as_such_in_the_queue():
    s, (a, b, c) = three_full_blocks()
    step(s)  # c is preempted
    snap = s.snapshot()
    phases = {v.request_id: (v.phase, v.num_preemptions) for v in snap.requests}
    assert phases == {"a": ("decode", 0), "b": ("decode", 0), "c": ("preempted", 1)}
    assert [v.request_id for v in snap.requests] == ["a", "b", "c"]  # running first
    assert snap.num_waiting == 1


def test_siblings_are_told_apart_by_index_under_their_client_request():
    s = make()
    s.add_request(req("g", 6, n=3))
    step(s)
    snap = s.snapshot()
    assert sorted((v.request_id, v.index) for v in snap.requests) == [("g", 0), ("g", 1), ("g", 2)]
    # They share the prompt's blocks: the full one shared, the partial one to copy.
    assert snap.block_states[:2] == b"34"


def test_a_long_queue_lists_only_its_head_but_counts_all():
    s = make(num_blocks=4, max_num_seqs=1)
    for i in range(MAX_WAITING_LISTED + 10):
        s.add_request(req(f"w{i}", 2))
    snap = s.snapshot()
    assert len(snap.requests) == MAX_WAITING_LISTED
    assert snap.num_waiting == MAX_WAITING_LISTED + 10


def test_a_snapshot_crosses_a_process_pipe():
    s = make()
    s.add_request(req("a", 5))
    step(s)
    snap = s.snapshot()
    assert pickle.loads(pickle.dumps(snap)) == snap
