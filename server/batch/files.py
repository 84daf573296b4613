"""The files /v1/files keeps: uploads (purpose "batch") and the output and error
files batch jobs write, each a JSONL file on disk beside a small JSON record of it,
under one folder ($KVSERVE_CACHE/batch/files). They survive a restart, as the jobs
that read and write them do.

All of them together stay within a byte budget (--files-store-bytes): an upload, or
a job's results, that would pass it is refused (507) rather than evicting anyone's
files; the owner deletes what they no longer need, as on OpenAI. Each file belongs
to the key that uploaded it (or whose job wrote it): another key's request finds it
absent (404), as stored responses are (server/auth.py)."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.server.errors import APIError

PURPOSES = ("batch",)  # what clients may upload
RESULT_PURPOSES = ("batch_output",)  # what jobs write (OpenAI's name for both files)


@dataclass
class StoredFile:
    id: str
    owner: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def view(self) -> dict:
        """The OpenAI FileObject."""
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class FileStore:
    """Owns the files' folder and its byte count. Thread-safe: uploads are copied
    in on a worker thread while jobs reserve room for their results."""

    def __init__(self, root: Path, budget: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}
        self._reserved = 0  # bytes jobs are writing now (their partial results)
        self._load()

    # -- disk ---------------------------------------------------------------
    def _load(self) -> None:
        for record in self.root.glob("*.json"):
            try:
                f = StoredFile(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # a record torn by a crash: its file is unreachable anyway
            if self.data_path(f.id).is_file():
                self._files[f.id] = f
        for tmp in self.root.glob("*.tmp"):  # uploads a crash left half copied
            tmp.unlink(missing_ok=True)

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def _write_record(self, f: StoredFile) -> None:
        tmp = self.root / f"{f.id}.json.tmp"
        tmp.write_text(json.dumps(asdict(f)))
        os.replace(tmp, self.root / f"{f.id}.json")

    @property
    def used(self) -> int:
        with self._lock:
            return sum(f.bytes for f in self._files.values()) + self._reserved

    def _check_room(self, size: int, what: str) -> None:
        """Under the lock."""
        used = sum(f.bytes for f in self._files.values()) + self._reserved
        if self.budget and used + size > self.budget:
            raise APIError(507, f"{what} of {size} bytes does not fit: the server's files "
                           f"hold {used} of {self.budget} bytes (--files-store-bytes); "
                           "delete files you no longer need", "file",
                           "insufficient_storage")

    # -- uploads ------------------------------------------------------------
    def add_upload(self, owner: str, filename: str, purpose: str, source) -> StoredFile:
        """Copies the uploaded file object `source` in (blocking: call it off the
        event loop)."""
        source.seek(0, os.SEEK_END)
        size = source.tell()
        source.seek(0)
        f = StoredFile(new_id("file-"), owner, size, int(time.time()), filename[:256],
                       purpose)
        with self._lock:
            self._check_room(size, "the file")
            self._reserved += size
        try:
            tmp = self.root / f"{f.id}.tmp"
            with open(tmp, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            os.replace(tmp, self.data_path(f.id))
            self._write_record(f)
        finally:
            with self._lock:
                self._reserved -= size
        with self._lock:
            self._files[f.id] = f
        return f

    # -- results written by jobs -----------------------------------------------
    def reserve(self, size: int) -> None:
        """Room for `size` more bytes of a job's results; 507 past the budget."""
        with self._lock:
            self._check_room(size, "a batch's results")
            self._reserved += size

    def release(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def adopt(self, owner: str, path: Path, filename: str, purpose: str) -> StoredFile:
        """Makes the finished results at `path` a file of `owner` (moved in); the
        caller releases what it reserved for them."""
        size = path.stat().st_size
        f = StoredFile(new_id("file-"), owner, size, int(time.time()), filename, purpose)
        os.replace(path, self.data_path(f.id))
        self._write_record(f)
        with self._lock:
            self._files[f.id] = f
        return f

    # -- reads ----------------------------------------------------------------
    def get(self, file_id: str, owner: str) -> StoredFile:
        with self._lock:
            f = self._files.get(file_id)
        if f is None or f.owner != owner:
            raise APIError(404, f"No file found with id '{file_id}'.", "file_id",
                           "not_found")
        return f

    def list(self, owner: str, purpose: str | None = None) -> list[StoredFile]:
        """Newest first."""
        with self._lock:
            mine = [f for f in self._files.values() if f.owner == owner
                    and (purpose is None or f.purpose == purpose)]
        return sorted(mine, key=lambda f: (f.created_at, f.id), reverse=True)

    def delete(self, file_id: str, owner: str) -> StoredFile:
        f = self.get(file_id, owner)
        with self._lock:
            self._files.pop(file_id, None)
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)
        return f
