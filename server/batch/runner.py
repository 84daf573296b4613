"""Runs batch jobs, one at a time in the order they were created, each with at most
--batch-concurrency of its lines in the engine at once; the lines are background
requests, so interactive clients keep their place ahead of them.

A job's answers are appended to two partial files as they come (successes, and
failures with the lines that could not be sent), in the order they finish. When a
restart interrupts a job, the next start resumes it: the partial files are read
back (a last line torn by the crash is cut off), the lines they answer are skipped,
and the rest are served; no line is lost and none is answered twice. At the end the
partial files become the job's output and error files (server/batch/files.py),
counted in the files' byte budget as they are written: a job whose answers do not
fit fails, keeping the answers it had. Cancelling stops the job at once (lines in
flight are aborted); past its completion window a job expires, each line it did not
serve answered in the error file as `batch_expired`. Both keep what was done."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from pathlib import Path

from kvserve.server.auth import Principal
from kvserve.server.batch.files import FileStore
from kvserve.server.batch.jobs import Batch, JobStore
from kvserve.server.batch.lines import (MAX_LINES, LineDispatcher, failed_line,
                                        parse_lines, succeeded)
from kvserve.server.errors import APIError

log = logging.getLogger("kvserve.batch")

READ_AHEAD_LINES = 64  # parsed per trip to the reader thread
SAVE_EVERY_S = 1.0  # a running job's counts reach its record at most this often


class BatchRunner:
    def __init__(self, files: FileStore, jobs: JobStore, dispatcher: LineDispatcher,
                 concurrency: int, max_body_bytes: int = 0):
        self.files, self.jobs, self.dispatcher = files, jobs, dispatcher
        self.concurrency, self.max_body_bytes = concurrency, max_body_bytes
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._current: tuple[str, asyncio.Task] | None = None  # the job running now
        self._stopping = False

    # -- lifetime ----------------------------------------------------------------
    def start(self) -> None:
        """Queues the jobs a previous run left unfinished, then runs jobs as they
        come."""
        for job in self.jobs.unfinished():
            self._queue.put_nowait(job.id)
        self._task = asyncio.get_running_loop().create_task(self._run_forever())

    async def stop(self) -> None:
        """Stops where it is: the lines in flight are aborted, and the job stays
        unfinished on disk, to be resumed by the next start."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.dispatcher.close()

    # -- requests from the routes -----------------------------------------------------
    def submit(self, job: Batch) -> None:
        self.jobs.save(job)
        self._queue.put_nowait(job.id)

    def cancel(self, job: Batch) -> None:
        """The job stops at once, its lines in flight aborted; a job still queued is
        finished as cancelled when its turn comes (at once: it reads no line)."""
        if job.finished or job.status == "cancelling":
            return
        job.mark("cancelling")
        self.jobs.save(job)
        if self._current is not None and self._current[0] == job.id:
            self._current[1].cancel()

    # -- running -------------------------------------------------------------------
    async def _run_forever(self) -> None:
        while True:
            job = self.jobs.find(await self._queue.get())
            if job is None or job.finished:
                continue
            task = asyncio.create_task(self._run(job))
            self._current = job.id, task
            try:
                await task
            except asyncio.CancelledError:
                if self._stopping:
                    raise
                if not job.finished:  # its cancel came before it served a line
                    self._finalize(job, "cancelled", _Answers(job, self))
            except Exception as exc:  # a bug: this job fails, the next ones run
                log.exception("batch %s failed", job.id)
                self._fail(job, "internal_error", f"internal error: {type(exc).__name__}")
            finally:
                self._current = None

    async def _run(self, job: Batch) -> None:
        if job.status == "cancelling":
            return self._finalize(job, "cancelled", None)
        if job.status == "finalizing":  # a restart came while it was moving its files
            return self._finalize(job, job.outcome or "completed", _Answers(job, self))
        source = self.files.data_path(job.input_file_id)
        if job.status == "validating":
            total = await asyncio.to_thread(_count_lines, source)
            if total is None:
                return self._fail(job, "file_not_found", f"the input file "
                                  f"{job.input_file_id} was deleted before the batch ran")
            if total > MAX_LINES:
                return self._fail(job, "too_many_requests", f"the input file has {total} "
                                  f"requests; a batch may have at most {MAX_LINES}")
            job.total = total
            job.mark("in_progress")
            self.jobs.save(job)
        done = _Answers(job, self)
        job.completed, job.failed = await asyncio.to_thread(done.resume)
        try:
            expired = await self._serve_lines(job, source, done)
        except asyncio.CancelledError:
            done.close()
            if self._stopping:
                self.jobs.save(job)  # its counts as they are: resumed at the next start
                raise
            return self._finalize(job, "cancelled", done)
        except APIError as exc:  # its answers no longer fit the files' budget
            done.close()
            return self._fail(job, "insufficient_storage", exc.message, done)
        done.close()
        self._finalize(job, "expired" if expired else "completed", done)

    async def _serve_lines(self, job: Batch, source: Path, done: _Answers) -> bool:
        """Serves the lines not answered yet; True if the job expired on the way."""
        owner = Principal(job.owner, sees_request_ids=False)
        in_flight: set[asyncio.Task] = set()
        seats = asyncio.Semaphore(self.concurrency)
        failures: list[BaseException] = []  # the files' budget (APIError), or a bug
        seen: Counter[str] = Counter()
        expired, last_save = False, time.monotonic()
        try:
            with open(source, "rb") as f:
                lines = parse_lines(f, job.endpoint, self.max_body_bytes)
                while batch := await asyncio.to_thread(_take, lines, READ_AHEAD_LINES):
                    for line in batch:
                        if failures:
                            raise failures[0]
                        if not _still_to_answer(line, seen, done):
                            continue
                        expired = expired or time.time() > job.expires_at
                        if expired:  # the rest are answered so, and nothing more is sent
                            done.add(failed_line(line, "batch_expired", EXPIRED))
                            job.failed += 1
                            continue
                        await seats.acquire()
                        task = asyncio.create_task(
                            self._serve(job, line, owner, done, seats, failures))
                        in_flight.add(task)
                        task.add_done_callback(in_flight.discard)
                        if time.monotonic() - last_save > SAVE_EVERY_S:
                            self.jobs.save(job)
                            last_save = time.monotonic()
                while in_flight:
                    await asyncio.wait(set(in_flight))
                if failures:
                    raise failures[0]
        finally:
            for task in in_flight:  # cancelled, stopped or failed: abort what is left
                task.cancel()
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
        return expired

    async def _serve(self, job: Batch, line, owner: Principal, done: _Answers,
                     seats: asyncio.Semaphore, failures: list[BaseException]) -> None:
        try:
            record = await self.dispatcher.serve(line, owner)
            done.add(record)
            if succeeded(record):
                job.completed += 1
                job.count_usage(record["response"]["body"])
            else:
                job.failed += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failures.append(exc)
        finally:
            seats.release()

    # -- endings -------------------------------------------------------------------
    def _finalize(self, job: Batch, outcome: str, done: _Answers | None) -> None:
        """Makes the partial files the job's output and error files, and ends it
        as `outcome` (completed, cancelled, expired)."""
        if done is not None:
            job.outcome = outcome
            job.mark("finalizing")
            self.jobs.save(job)
            done.adopt()
        job.mark(outcome)
        self.jobs.save(job)
        log.info("batch %s %s: %d of %d lines answered, %d failed", job.id, outcome,
                 job.completed + job.failed, job.total, job.failed)

    def _fail(self, job: Batch, code: str, message: str, done: _Answers | None = None
              ) -> None:
        job.errors.append({"code": code, "message": message, "param": None, "line": None})
        if done is not None:  # what it had answered stays readable
            done.adopt()
        job.mark("failed")
        self.jobs.save(job)
        log.warning("batch %s failed: %s", job.id, message)


class _Answers:
    """A job's two partial files and what they answer (custom_id -> how many times),
    their bytes reserved in the files' budget as they are written."""

    def __init__(self, job: Batch, runner: BatchRunner):
        self.job, self.files, self.jobs = job, runner.files, runner.jobs
        self.paths = {kind: runner.jobs.partial_path(job.id, kind)
                      for kind in ("output", "error")}
        self.answered: Counter[str] = Counter()
        self._handles = {}
        self._reserved = 0

    def resume(self) -> tuple[int, int]:
        """Reads back what an earlier run answered, and opens the files to add to
        them; (succeeded, failed)."""
        counts = []
        job = self.job
        job.input_tokens = job.cached_tokens = job.output_tokens = 0
        for kind, path in self.paths.items():
            n = 0
            if path.exists():
                _cut_torn_line(path)
                with open(path, "rb") as f:
                    for raw in f:
                        record = json.loads(raw)
                        if record.get("custom_id") is not None:
                            self.answered[record["custom_id"]] += 1
                        if kind == "output":
                            job.count_usage(record["response"]["body"])
                        n += 1
                size = path.stat().st_size
                self.files.reserve(size)
                self._reserved += size
            counts.append(n)
            self._handles[kind] = open(path, "ab")
        return counts[0], counts[1]

    def add(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        self.files.reserve(len(data))  # 507 (APIError) once past the budget
        self._reserved += len(data)
        handle = self._handles["output" if succeeded(record) else "error"]
        handle.write(data)
        handle.flush()  # a crash loses at most the line being written

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()

    def adopt(self) -> None:
        """The partial files become the owner's files, each id recorded as soon as
        it is one (a restart in between finishes the other); an empty one is
        dropped, as OpenAI leaves an id out when it has nothing."""
        job = self.job
        for kind, path in self.paths.items():
            if path.exists() and path.stat().st_size:
                stored = self.files.adopt(job.owner, path, f"{job.id}_{kind}.jsonl",
                                          "batch_output")
                setattr(job, f"{kind}_file_id", stored.id)
                self.jobs.save(job)
            else:
                path.unlink(missing_ok=True)
        self.files.release(self._reserved)
        self._reserved = 0


EXPIRED = "This request could not be executed before the completion window expired."


def _still_to_answer(line, seen: Counter, done: _Answers) -> bool:
    """False for a line an earlier run answered (the first as many lines with its
    custom_id as the partial files answer); a later line reusing a custom_id is
    answered with that error."""
    if line.custom_id is None:
        return True
    seen[line.custom_id] += 1
    if seen[line.custom_id] <= done.answered[line.custom_id]:
        return False
    if seen[line.custom_id] > 1 and not line.error:
        line.error = (f"line {line.number}: `custom_id` {line.custom_id!r} is used by an "
                      "earlier line")
    return True


def _take(lines, n: int) -> list:
    out = []
    for line in lines:
        out.append(line)
        if len(out) == n:
            break
    return out


def _count_lines(path: Path) -> int | None:
    """Non-blank lines; None if the file is gone."""
    try:
        with open(path, "rb") as f:
            return sum(1 for raw in f if raw.strip())
    except FileNotFoundError:
        return None


def _cut_torn_line(path: Path) -> None:
    """Cuts a last line a crash left without its newline (never a whole answer)."""
    with open(path, "rb+") as f:
        end = pos = f.seek(0, 2)
        while pos > 0:
            step = min(pos, 1 << 20)
            f.seek(pos - step)
            chunk = f.read(step)
            if pos == end and chunk.endswith(b"\n"):
                return
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(pos - step + cut + 1)
                return
            pos -= step
        f.truncate(0)  # no whole line at all
