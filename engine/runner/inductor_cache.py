"""Inductor's on-disk cache under $KVSERVE_CACHE/inductor kept within a byte budget.

Why: nothing else bounds it. Each version of kvserve's op schemas gets a folder of its
own (compile_process.ops_key), so every upgrade left the last one behind, and where
Dynamo builds frozen graphs (torch's oneDNN GEMMs) each graph's library holds a copy
of the weights: a 1B model's Dynamo fallback once left 18 GB there and filled the
disk, and the next package build died writing its zip.

What is removed, and why that is safe:
- the folders of other op-schema versions not used for STALE_S (their graphs could
  not be loaded by this version anyway: a graph called through an old schema
  segfaults); a folder in use by another version's server is marked at its start;
- in this version's folder, past the budget, the files least recently used first (the
  later of access and modification times: with relatime mounts a read moves the
  access time at most once a day), never one written since this process began using
  the cache (a file it only read may go: it is loaded already). Inductor rebuilds whatever is missing: a graph entry
  whose kernel's source or library is gone writes the source again and recompiles it,
  and a missing graph entry is a cache miss (checked on torch 2.13:
  tests/engine/test_inductor_cache.py runs a cached compile after such removals).
Checked at start (use_cache_dir) and again once the forward pass is compiled."""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("kvserve.compile")

# A folder of another op-schema version is left alone this long after its last start:
# two kvserve versions sharing one cache (a rolling upgrade) do not empty each other's.
STALE_S = 3600.0
MARKER = ".kvserve-last-used"


def mark_used(folder: Path) -> None:
    """Says this version's folder is in use (remove_other_versions reads it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).touch()


def remove_other_versions(folder: Path, stale_s: float = STALE_S) -> int:
    """Removes the sibling folders of `folder` (other op-schema versions' caches)
    not marked used for stale_s; returns the bytes freed."""
    freed = 0
    now = time.time()
    for other in folder.parent.iterdir():
        if other == folder or not other.is_dir():
            continue
        marker = other / MARKER
        last = (marker if marker.exists() else other).stat().st_mtime
        if now - last < stale_s:
            continue
        size = tree_bytes(other)
        shutil.rmtree(other, ignore_errors=True)
        freed += size
        log.info("removed Inductor's cache of another kvserve version (%.1f MiB): %s",
                 size / 2**20, other)
    return freed


def trim(folder: Path, budget: int, since: float) -> int:
    """Removes the least recently used files of `folder` until it holds at most
    `budget` bytes, keeping every file used at or after `since` (what this process
    wrote); returns the bytes freed."""
    files = []
    total = 0
    for path in _files(folder):
        try:
            st = path.stat()
        except OSError:  # removed meanwhile (another process's trim, Inductor itself)
            continue
        total += st.st_size
        if path.name != MARKER:
            files.append((max(st.st_atime, st.st_mtime), st.st_size, path))
    if total <= budget:
        return 0
    freed = 0
    for used, size, path in sorted(files, key=lambda f: f[0]):
        if total - freed <= budget or used >= since:
            break
        try:
            path.unlink()
        except OSError:
            continue
        freed += size
    _remove_empty_dirs(folder)
    log.info("Inductor's cache held %.1f MiB, over its %.1f MiB budget: removed "
             "%.1f MiB of its least recently used files (%s)", total / 2**20,
             budget / 2**20, freed / 2**20, folder)
    return freed


def tree_bytes(folder: Path) -> int:
    total = 0
    for path in _files(folder):
        try:
            total += path.stat().st_size
        except OSError:
            continue
    return total


def _files(folder: Path):
    for parent, _, names in os.walk(folder):
        for name in names:
            yield Path(parent, name)


def _remove_empty_dirs(folder: Path) -> None:
    for parent, _, _ in os.walk(folder, topdown=False):
        if Path(parent) != folder:
            try:
                os.rmdir(parent)  # only an empty one goes
            except OSError:
                pass
