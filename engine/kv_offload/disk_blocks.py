"""The second KV tier's blocks on local disk: one file per block hash, its bytes
behind a header of magic, length and BLAKE2b digest, so a torn or corrupted file
is found when it is read and the block is computed again, never served.

The files of one cache layout (model, block size, dtype, shapes: the caller's
`layout` fingerprint) share a directory, so blocks written by an earlier run of
the same model are found again after a restart (block hashes are sha256 chains,
the same in every process), and a change of layout never reads them. Writes go to
a temporary file renamed into place: a crash leaves an old block or none. The
directory is the operator's, made 0700, its files 0600; the total is capped (the
least recently used go first)."""
from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("kvserve.kv_offload")

_MAGIC = b"kvserve-kvblock1"
_HEADER = len(_MAGIC) + 8 + 32  # magic, payload length, digest
_SUFFIX = ".kvb"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _digest(payload) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskBlocks:
    def __init__(self, root: str | os.PathLike, layout: str, capacity_bytes: int):
        self.dir = Path(root) / layout
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes, LRU first
        self.used_bytes = 0
        self.corrupt = 0  # files dropped because their checksum or length was wrong
        self._scan()

    def _scan(self) -> None:
        """Blocks an earlier run left, oldest first; leftovers of torn writes go."""
        found = []
        for path in self.dir.iterdir():
            if path.suffix != _SUFFIX:
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                continue
            try:
                block_hash = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime, block_hash, st.st_size))
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
            self.used_bytes += size
        self._trim(0)
        if self._files:
            log.info("second KV tier: %d blocks (%d MiB) on disk in %s", len(self._files),
                     self.used_bytes >> 20, self.dir)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + _SUFFIX)

    def _trim(self, room: int) -> None:
        while self._files and self.used_bytes + room > self.capacity_bytes:
            self._drop(next(iter(self._files)))

    def _drop(self, block_hash: bytes) -> None:
        self.used_bytes -= self._files.pop(block_hash)
        self._path(block_hash).unlink(missing_ok=True)

    def write(self, block_hash: bytes, payload: memoryview) -> None:
        """Keeps `payload` as block_hash's (already there: only marked recent)."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return
        size = _HEADER + payload.nbytes
        if size > self.capacity_bytes:
            return
        self._trim(size)
        path = self._path(block_hash)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + payload.nbytes.to_bytes(8, "little") + _digest(payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:  # a full disk loses the block, not the engine
            tmp.unlink(missing_ok=True)
            log.warning("second KV tier: could not write a block to %s: %s", self.dir, e)
            return
        self._files[block_hash] = size
        self.used_bytes += size

    def read(self, block_hash: bytes, expected_bytes: int) -> bytearray | None:
        """The block's payload, or None (and the file dropped) when it is missing,
        of the wrong length or fails its digest."""
        if block_hash not in self._files:
            return None
        try:
            fd = os.open(self._path(block_hash), os.O_RDONLY | _NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                data = bytearray(f.read(_HEADER + expected_bytes + 1))
        except OSError:
            data = bytearray()
        payload = memoryview(data)[_HEADER:]
        if (len(data) != _HEADER + expected_bytes or not data.startswith(_MAGIC)
                or int.from_bytes(data[len(_MAGIC):len(_MAGIC) + 8], "little")
                != expected_bytes
                or data[len(_MAGIC) + 8:_HEADER] != _digest(payload)):
            self.corrupt += 1
            log.warning("second KV tier: block %s on disk is corrupt or truncated: "
                        "dropped, its tokens are computed again", block_hash.hex()[:16])
            payload.release()
            self._drop(block_hash)
            return None
        self._files.move_to_end(block_hash)
        payload.release()
        del data[:_HEADER]
        return data

    def clear(self) -> None:
        for block_hash in list(self._files):
            self._drop(block_hash)
