"""The batch runner and its stores without a model (a fake dispatcher answers each
line): expiry, the files' byte budget, a deleted input file, the line cap, a queued
job cancelled, the stores read back after a restart, and torn partial lines."""
from __future__ import annotations

import asyncio
import io
import json
import time

import pytest

from kvserve.server.auth import ANONYMOUS
from kvserve.server.batch import lines as lines_module
from kvserve.server.batch import runner as runner_module
from kvserve.server.batch.files import FileStore
from kvserve.server.batch.jobs import Batch, JobStore
from kvserve.server.batch.lines import Line, failed_line
from kvserve.server.batch.runner import BatchRunner, _cut_torn_line
from kvserve.server.errors import APIError


class FakeDispatcher:
    """Answers every line 200 after `delay` seconds, its body `size` bytes."""

    def __init__(self, delay: float = 0.0, size: int = 10):
        self.delay, self.size, self.served = delay, size, []

    async def serve(self, line: Line, owner) -> dict:
        if line.error:
            return failed_line(line)
        await asyncio.sleep(self.delay)
        self.served.append(line.custom_id)
        return {"id": "batch_req_x", "custom_id": line.custom_id, "error": None,
                "response": {"status_code": 200, "request_id": "r",
                             "body": {"text": "x" * self.size,
                                      "usage": {"prompt_tokens": 3, "completion_tokens": 2}}}}

    async def close(self) -> None:
        pass


def chat(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def stores(tmp_path, budget: int = 0):
    return FileStore(tmp_path / "files", budget), JobStore(tmp_path / "jobs")


def add_input(files: FileStore, lines: list) -> str:
    data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
    return files.add_upload("owner", "in.jsonl", "batch", io.BytesIO(data)).id


def new_job(file_id: str, job_id: str = "batch_1", window: int = 3600) -> Batch:
    now = int(time.time())
    return Batch(job_id, "owner", "/v1/chat/completions", file_id, "24h", now, now + window)


async def run_jobs(files, jobs, dispatcher, *submitted, concurrency: int = 4,
                   before_start=None) -> None:
    runner = BatchRunner(files, jobs, dispatcher, concurrency)
    for job in submitted:
        jobs.save(job)
    if before_start:
        before_start(runner)
    runner.start()
    deadline = time.monotonic() + 30
    while jobs.unfinished():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await runner.stop()


def read(files: FileStore, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in files.data_path(file_id).read_text().splitlines()]


def test_a_job_runs_to_completion_and_counts_usage(tmp_path):
    files, jobs = stores(tmp_path)
    job = new_job(add_input(files, [chat(f"q{i}") for i in range(7)]))
    asyncio.run(run_jobs(files, jobs, FakeDispatcher(), job))
    assert job.status == "completed" and (job.total, job.completed, job.failed) == (7, 7, 0)
    assert sorted(r["custom_id"] for r in read(files, job.output_file_id)) == \
        sorted(f"q{i}" for i in range(7))
    assert job.error_file_id is None
    assert job.view()["usage"]["total_tokens"] == 35
    assert not list((tmp_path / "jobs").glob("*.partial"))


def test_past_its_window_a_job_expires_and_answers_the_rest_so(tmp_path):
    files, jobs = stores(tmp_path)
    job = new_job(add_input(files, [chat(f"q{i}") for i in range(3)]), window=-1)
    dispatcher = FakeDispatcher()
    asyncio.run(run_jobs(files, jobs, dispatcher, job))
    assert job.status == "expired" and job.expired_at is not None
    assert dispatcher.served == [] and (job.completed, job.failed) == (0, 3)
    assert {e["error"]["code"] for e in read(files, job.error_file_id)} == {"batch_expired"}


def test_answers_past_the_files_budget_fail_the_job_keeping_those_that_fit(tmp_path):
    files, jobs = stores(tmp_path)
    job = new_job(add_input(files, [chat(f"q{i}") for i in range(20)]))
    files.budget = files.used + 2000  # room for 3 answers of ~590 bytes
    asyncio.run(run_jobs(files, jobs, FakeDispatcher(size=400), job, concurrency=1))
    assert job.status == "failed" and job.errors[0]["code"] == "insufficient_storage"
    kept = read(files, job.output_file_id)
    assert len(kept) == job.completed == 3 and files.used <= files.budget
    with pytest.raises(APIError) as err:  # and an upload now finds no room either
        files.add_upload("owner", "x", "batch", io.BytesIO(b"x" * 500))
    assert err.value.status == 507


def test_a_deleted_input_file_or_too_many_lines_fail_the_job(tmp_path, monkeypatch):
    files, jobs = stores(tmp_path)
    gone = new_job(add_input(files, [chat("a")]), "batch_gone")
    files.delete(gone.input_file_id, "owner")
    monkeypatch.setattr(runner_module, "MAX_LINES", 2)
    many = new_job(add_input(files, [chat(f"q{i}") for i in range(3)]), "batch_many")
    asyncio.run(run_jobs(files, jobs, FakeDispatcher(), gone, many))
    assert gone.status == "failed" and gone.errors[0]["code"] == "file_not_found"
    assert many.status == "failed" and "at most 2" in many.errors[0]["message"]


def test_a_queued_job_cancelled_ends_without_serving_a_line(tmp_path):
    files, jobs = stores(tmp_path)
    first = new_job(add_input(files, [chat(f"a{i}") for i in range(4)]), "batch_a")
    second = new_job(add_input(files, [chat("b")]), "batch_b")
    dispatcher = FakeDispatcher(delay=0.05)
    asyncio.run(run_jobs(files, jobs, dispatcher, first, second,
                         before_start=lambda runner: runner.cancel(second)))
    assert first.status == "completed" and second.status == "cancelled"
    assert "b" not in dispatcher.served and second.output_file_id is None


def test_stores_read_back_what_they_held_after_a_restart(tmp_path):
    files, jobs = stores(tmp_path)
    job = new_job(add_input(files, [chat("a")]))
    asyncio.run(run_jobs(files, jobs, FakeDispatcher(), job))
    (tmp_path / "jobs" / "batch_torn.json").write_text('{"id": "batch_to')  # not a job
    files2, jobs2 = stores(tmp_path)
    assert jobs2.get(job.id, "owner").view() == job.view()
    assert files2.get(job.output_file_id, "owner").bytes == files.get(
        job.output_file_id, "owner").bytes
    assert files2.used == files.used
    with pytest.raises(APIError):
        jobs2.get(job.id, "someone else")


@pytest.mark.parametrize("content, kept", [
    (b"", b""), (b"a\nb\n", b"a\nb\n"), (b"a\nb\nto", b"a\nb\n"), (b"torn", b""),
    (b"a\n" + b"x" * (3 << 20), b"a\n"),  # a torn line longer than one read
])
def test_a_torn_last_line_is_cut(tmp_path, content, kept):
    path = tmp_path / "p"
    path.write_bytes(content)
    _cut_torn_line(path)
    assert path.read_bytes() == kept


def test_a_line_past_the_body_limit_is_refused_unparsed():
    small, big = json.dumps(chat("a")).encode(), b"{" + b" " * 20_000 + b"}"
    got = list(lines_module.parse_lines(io.BytesIO(small + b"\n" + big + b"\n"), None,
                                        max_body_bytes=1000))
    assert got[0].error is None
    assert got[1].custom_id is None and "--max-request-body-bytes" in got[1].error


def test_lines_are_checked_before_they_are_sent():
    raw = io.BytesIO(b"\n".join([
        json.dumps(chat("ok")).encode(), b"", b"[1, 2]",
        json.dumps({**chat("m"), "method": "GET"}).encode(),
        json.dumps({**chat("u"), "url": "/v1/models"}).encode(),
        json.dumps({**chat("b"), "body": "text"}).encode(),
        json.dumps({**chat(""), "custom_id": ""}).encode(),
        json.dumps({**chat("x" * 600)}).encode(),
    ]))
    got = list(lines_module.parse_lines(raw, None))
    assert [ln.number for ln in got] == list(range(1, 8))
    assert got[0].error is None and json.loads(got[0].body)["model"] == "m"
    assert [bool(ln.error) for ln in got] == [False] + [True] * 6
    assert "method" in got[2].error and "url" in got[3].error and "body" in got[4].error
    assert "custom_id" in got[5].error and "longer" in got[6].error
