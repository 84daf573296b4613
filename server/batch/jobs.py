"""Batch jobs' records: OpenAI's Batch object, one JSON file each under
$KVSERVE_CACHE/batch/jobs, rewritten (atomically) as a job moves on, so a restart
finds every job where it was: finished ones as they ended, unfinished ones to be
resumed (runner.py). The runner alone changes a job's state; the routes read it."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.server.errors import APIError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}  # the one window OpenAI offers
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass
class Batch:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] = field(default_factory=list)  # why the whole job failed
    total: int = 0
    completed: int = 0
    failed: int = 0
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    outcome: str | None = None  # while finalizing: the status it will end in
    input_tokens: int = 0  # its answered lines' usage, summed
    cached_tokens: int = 0
    output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED

    def mark(self, status: str) -> None:
        """Moves to `status`, stamping its time (OpenAI's `<status>_at`)."""
        self.status = status
        stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at",
                 "completed": "completed_at", "failed": "failed_at",
                 "expired": "expired_at", "cancelling": "cancelling_at",
                 "cancelled": "cancelled_at"}.get(status)
        if stamp:
            setattr(self, stamp, int(time.time()))

    def count_usage(self, body: dict) -> None:
        """Adds an answer's usage (chat and completions name it prompt/completion
        tokens, the Responses API input/output tokens)."""
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        self.input_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        self.output_tokens += (usage.get("completion_tokens", usage.get("output_tokens", 0))
                               or 0)
        details = (usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
                   or {})
        self.cached_tokens += details.get("cached_tokens", 0) or 0

    def view(self) -> dict:
        """The OpenAI Batch object."""
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": ({"object": "list", "data": self.errors} if self.errors else None),
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "status": self.status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at, "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata,
            "usage": {"input_tokens": self.input_tokens,
                      "input_tokens_details": {"cached_tokens": self.cached_tokens},
                      "output_tokens": self.output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
        }


class JobStore:
    """Every job's record, in memory and on disk."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Batch] = {}
        for record in sorted(self.root.glob("*.json")):
            try:
                job = Batch(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # never written whole (the write is atomic): not a job
            self._jobs[job.id] = job

    def save(self, job: Batch) -> None:
        self._jobs[job.id] = job
        tmp = self.root / f"{job.id}.json.tmp"
        tmp.write_text(json.dumps(asdict(job)))
        os.replace(tmp, self.root / f"{job.id}.json")

    def partial_path(self, job_id: str, kind: str) -> Path:
        """Where a job appends its `kind` ("output" or "error") lines as they come."""
        return self.root / f"{job_id}.{kind}.partial"

    def find(self, job_id: str) -> Batch | None:
        return self._jobs.get(job_id)

    def get(self, job_id: str, owner: str) -> Batch:
        job = self._jobs.get(job_id)
        if job is None or job.owner != owner:
            raise APIError(404, f"No batch found with id '{job_id}'.", "batch_id",
                           "not_found")
        return job

    def unfinished(self) -> list[Batch]:
        """Oldest first: the order they run in."""
        return sorted((j for j in self._jobs.values() if not j.finished),
                      key=lambda j: (j.created_at, j.id))

    def count_unfinished(self, owner: str) -> int:
        return sum(1 for j in self._jobs.values() if j.owner == owner and not j.finished)

    def list(self, owner: str) -> list[Batch]:
        """Newest first."""
        mine = [j for j in self._jobs.values() if j.owner == owner]
        return sorted(mine, key=lambda j: (j.created_at, j.id), reverse=True)
