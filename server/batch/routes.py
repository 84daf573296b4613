"""/v1/files and /v1/batches, as OpenAI serves them. Behind the key like every /v1
route; each file and job belongs to the key that made it (server/auth.py). What one
request may cost: an upload at most --max-upload-bytes (streamed to disk, never
held in memory: server/limits.py), within the files' --files-store-bytes together;
a job at most 50,000 lines (lines.py), run after the jobs before it, each line a
request with the usual limits; at most MAX_UNFINISHED_JOBS unfinished jobs a key;
a listing at most 100 (batches) or 10,000 (files) items."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from kvserve.modelstore.default_model import cache_root
from kvserve.server.auth import current_principal
from kvserve.server.batch.files import PURPOSES, FileStore, new_id
from kvserve.server.batch.jobs import COMPLETION_WINDOW_S, ENDPOINTS, Batch, JobStore
from kvserve.server.batch.lines import LineDispatcher
from kvserve.server.batch.runner import BatchRunner
from kvserve.server.config import ServerConfig
from kvserve.server.errors import APIError

MAX_UNFINISHED_JOBS = 64  # a key's jobs queued or running at once
MAX_METADATA = 16  # OpenAI's limits on a batch's metadata
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


def default_batch_dir() -> Path:
    return cache_root() / "batch"


def install_batch(app: FastAPI, config: ServerConfig) -> BatchRunner:
    """The routes, over the stores under --batch-dir; the runner the app's lifespan
    starts after the engine and stops before it."""
    root = Path(config.batch_dir) if config.batch_dir else default_batch_dir()
    files = FileStore(root / "files", config.files_store_bytes)
    jobs = JobStore(root / "jobs")
    runner = BatchRunner(files, jobs, LineDispatcher(app), config.batch_concurrency,
                         config.max_request_body_bytes)
    app.include_router(files_router(files))
    app.include_router(batches_router(files, jobs, runner))
    return runner


class CreateBatchRequest(BaseModel):
    input_file_id: str = Field(max_length=256)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


# Read by hand (request.form, with its own caps), so FastAPI cannot describe it.
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"},
        "purpose": {"type": "string", "enum": list(PURPOSES)}}}}}}}


def _page(items: list, after: str | None, limit: int) -> dict:
    """OpenAI's cursor page over `items` (views, newest first): those after the id
    `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit}


def files_router(files: FileStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files", openapi_extra=UPLOAD_BODY)
    async def upload_file(request: Request):
        try:
            form = await request.form(max_files=1, max_fields=4, max_part_size=1024)
        except ClientDisconnect:  # gone, or refused past the upload's limits
            return Response(status_code=499)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str) or purpose not in PURPOSES:
                raise APIError(400, f"`purpose` must be one of {', '.join(PURPOSES)} "
                               "(this server keeps files for batch jobs)", "purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "send the file as the multipart field `file`", "file")
            stored = await asyncio.to_thread(files.add_upload, current_principal().owner,
                                             upload.filename or "upload.jsonl", purpose,
                                             upload.file)
        finally:
            await form.close()
        return stored.view()

    @router.get("/v1/files")
    async def list_files(purpose: str | None = None, after: str | None = None,
                         limit: int = Query(10000, ge=1, le=10000),
                         order: str = Query("desc", pattern="^(asc|desc)$")):
        views = [f.view() for f in files.list(current_principal().owner, purpose)]
        if order == "asc":
            views.reverse()
        return _page(views, after, limit)

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return files.get(file_id, current_principal().owner).view()

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        files.delete(file_id, current_principal().owner)
        return {"id": file_id, "object": "file", "deleted": True}

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        stored = files.get(file_id, current_principal().owner)
        # Read from disk in chunks on a worker thread (Starlette's FileResponse).
        return FileResponse(files.data_path(stored.id), media_type="application/octet-stream",
                            filename=stored.filename)

    return router


def batches_router(files: FileStore, jobs: JobStore, runner: BatchRunner) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches")
    async def create_batch(req: CreateBatchRequest):
        owner = current_principal().owner
        if req.endpoint not in ENDPOINTS:
            raise APIError(400, f"`endpoint` must be one of {', '.join(ENDPOINTS)}",
                           "endpoint")
        window = COMPLETION_WINDOW_S.get(req.completion_window)
        if window is None:
            raise APIError(400, "`completion_window` must be 24h", "completion_window")
        _check_metadata(req.metadata)
        source = files.get(req.input_file_id, owner)  # 404 for another key's
        if source.purpose != "batch":
            raise APIError(400, f"file {source.id} has purpose {source.purpose!r}; a "
                           "batch reads a file uploaded with purpose \"batch\"",
                           "input_file_id")
        if jobs.count_unfinished(owner) >= MAX_UNFINISHED_JOBS:
            raise APIError(429, f"{MAX_UNFINISHED_JOBS} of your batches are still queued "
                           "or running; wait for one to finish", None, "rate_limit_exceeded")
        now = int(time.time())
        job = Batch(new_id("batch_"), owner, req.endpoint, source.id,
                    req.completion_window, now, now + window, metadata=req.metadata)
        runner.submit(job)
        return job.view()

    @router.get("/v1/batches")
    async def list_batches(after: str | None = None,
                           limit: int = Query(20, ge=1, le=100)):
        return _page([j.view() for j in jobs.list(current_principal().owner)], after,
                     limit)

    @router.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return jobs.get(batch_id, current_principal().owner).view()

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        job = jobs.get(batch_id, current_principal().owner)
        if job.finished and job.status != "cancelled":
            raise APIError(409, f"batch {batch_id} has already ended ({job.status})",
                           "batch_id", "conflict")
        runner.cancel(job)
        return job.view()

    return router


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA:
        raise APIError(400, f"`metadata` may have at most {MAX_METADATA} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise APIError(400, f"`metadata` keys may have at most {MAX_METADATA_KEY} "
                           f"characters, values {MAX_METADATA_VALUE}", "metadata")
