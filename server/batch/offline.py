"""`kvserve run-batch -i in.jsonl -o out.jsonl`: a batch file's lines through the
server's own app in this process, with no socket and no job records, as vLLM's
run-batch does: the same input lines as /v1/batches, one answer line each in the
output file, in the input's order, failures included (a line that could not be
sent has `error` set; a refused request its status code and error body).

At most --batch-concurrency lines are in the engine at once; answers are written
as soon as every line before them is answered, so memory holds at most that many."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections import deque

from kvserve.server.auth import ANONYMOUS
from kvserve.server.batch.lines import LineDispatcher, parse_lines, succeeded
from kvserve.server.config import ServerConfig

log = logging.getLogger("kvserve.batch")


async def run_batch(app, input_path: str, output_path: str, concurrency: int,
                    max_body_bytes: int = 0) -> tuple[int, int]:
    """Serves every line of input_path (a path, or "-" for stdin) into
    output_path; (answered, failed)."""
    dispatcher = LineDispatcher(app)
    window: deque[asyncio.Task] = deque()
    answered = failed = 0
    seen: set[str] = set()
    with contextlib.ExitStack() as files:
        source = (sys.stdin.buffer if input_path == "-"
                  else files.enter_context(open(input_path, "rb")))
        out = files.enter_context(open(output_path, "w", encoding="utf-8"))

        async def write_oldest() -> None:
            nonlocal answered, failed
            record = await window.popleft()
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            answered += 1
            failed += not succeeded(record)

        lines = parse_lines(source, None, max_body_bytes)
        try:
            while line := await asyncio.to_thread(next, lines, None):
                if line.custom_id is not None and not line.error:
                    if line.custom_id in seen:
                        line.error = (f"line {line.number}: `custom_id` "
                                      f"{line.custom_id!r} is used by an earlier line")
                    seen.add(line.custom_id)
                if len(window) >= concurrency:
                    await write_oldest()
                window.append(asyncio.create_task(dispatcher.serve(line, ANONYMOUS)))
            while window:
                await write_oldest()
        finally:
            for task in window:
                task.cancel()
            await dispatcher.close()
    return answered, failed


def main(app, config: ServerConfig, input_path: str, output_path: str) -> int:
    """Runs the app (its engine not started yet) for the one file."""
    async def run() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            return await run_batch(app, input_path, output_path, config.batch_concurrency,
                                   config.max_request_body_bytes)

    answered, failed = asyncio.run(run())
    log.info("run-batch: %d line(s) answered into %s, %d of them failures", answered,
             output_path, failed)
    return 0
