"""The CPU kernel library's cache (engine/kernels/cpu/build.py): a library is loaded
from $KVSERVE_CACHE/cpu_kernels only if that directory is this user's and writable
by no one else (and so is every one above it, or it is root's, or sticky), the file
is this user's and writable by no one else, and its SHA-256 is the one recorded
when it was built. A bad library is built again in its place; a cache directory
others may write to is not used: the library is built privately instead.

The library is the session's own (built once, setup.load_once); each test copies it
into a temporary KVSERVE_CACHE and tampers with the copy. Building and loading are
stood in for: the build writes the good library's bytes, and loading (which a
process does once) records what it would have loaded, and that file's SHA-256 at
that moment."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest

from kvserve.engine.kernels.cpu import build

OTHER_UID = 65534  # nobody


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest_file(library: Path) -> Path:
    """Where a build records the library's SHA-256 (sha256sum's format)."""
    return library.with_name(library.name + ".sha256")


def copy_library(library: Path, to: Path) -> None:
    shutil.copy2(library, to)
    if digest_file(library).exists():
        shutil.copy2(digest_file(library), digest_file(to))


@pytest.fixture(scope="module")
def library() -> Path:
    """The session's library in the real cache (built there if need be)."""
    from kvserve.engine.weights.cpu_packing import load_once
    from kvserve.modelstore.default_model import cache_root

    try:
        load_once()
    except build.BuildError as exc:
        pytest.skip(f"the kernels cannot be built here: {exc}")
    return build.library_path(cache_root(), build.c_compiler())


class Stand:
    """The stand-ins for building and loading, and what they saw."""

    def __init__(self, good: bytes):
        self.good = good
        self.builds: list[tuple[Path, int]] = []  # (path, its directory's mode)
        self.loads: list[tuple[str, str]] = []  # (path, its SHA-256 when loaded)

    def build(self, compiler: str, path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.builds.append((path, os.stat(path.parent).st_mode & 0o7777))
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(self.good)
        return build._install(partial, path)

    def load(self, path: Path) -> None:
        self.loads.append((str(path), hashlib.sha256(path.read_bytes()).hexdigest()))


@pytest.fixture
def stand(library, monkeypatch) -> Stand:
    s = Stand(library.read_bytes())
    monkeypatch.setattr(build, "_build", s.build)
    monkeypatch.setattr(build, "_open", s.load)
    monkeypatch.setattr(build, "_loaded", build._loaded)
    return s


@pytest.fixture
def cache(tmp_path, library) -> Path:
    """A KVSERVE_CACHE holding a copy of the session's library and its digest."""
    root = tmp_path / "cache"
    copy = build.library_path(root, build.c_compiler())
    copy.parent.mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(copy.parent, 0o755)
    copy_library(library, copy)
    yield copy
    for p in (root, *root.rglob("*")):  # chowned or chmodded: back to removable
        if not p.is_symlink():
            os.chmod(p, 0o755)


def test_a_build_records_the_librarys_sha256_beside_it(library, tmp_path):
    """The session's real build recorded its digest; and _install makes the library
    writable by no one else whatever the umask."""
    assert build._recorded_digest(library) == sha256(library)
    assert digest_file(library).read_text().split() == [sha256(library), library.name]
    partial, target = tmp_path / ".partial", tmp_path / "kernels-x.so"
    partial.write_bytes(b"\x7fELF...")
    old = os.umask(0o002)
    try:
        os.chmod(partial, 0o777)
        digest = build._install(partial, target)
    finally:
        os.umask(old)
    assert digest == sha256(target) == build._recorded_digest(target)
    assert os.stat(target).st_mode & 0o777 == 0o755 and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels-x.so", "kernels-x.so.sha256"]


def test_a_checked_library_loads_from_the_cache_unbuilt(cache, stand):
    assert build.load_kernels(cache.parent.parent) == cache
    assert stand.builds == [] and stand.loads == [(str(cache), sha256(cache))]


def tamper(copy: Path, how: str) -> None:
    if how == "changed bytes":
        data = bytearray(copy.read_bytes())
        data[len(data) // 2] ^= 0xFF
        copy.write_bytes(bytes(data))
    elif how == "no recorded digest":
        digest_file(copy).unlink()
    elif how == "a wrong recorded digest":
        digest_file(copy).write_text("0" * 64 + f"  {copy.name}\n")
    elif how == "group-writable":
        os.chmod(copy, 0o775)
    elif how == "others-writable":
        os.chmod(copy, 0o757)
    elif how == "another owner":
        os.chown(copy, OTHER_UID, OTHER_UID)
    elif how == "a symlink":  # to a good copy elsewhere: still not followed
        elsewhere = copy.parent.parent / "elsewhere.so"
        copy.rename(elsewhere)
        copy.symlink_to(elsewhere)


@pytest.mark.parametrize("how", ["changed bytes", "no recorded digest",
                                 "a wrong recorded digest", "group-writable",
                                 "others-writable", "another owner", "a symlink"])
def test_a_library_failing_its_checks_is_built_again_not_loaded(cache, stand, how, caplog):
    if how == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another user takes root")
    tamper(cache, how)
    with caplog.at_level(logging.WARNING, logger="kvserve.cpu_kernels"):
        assert build.load_kernels(cache.parent.parent) == cache
    assert [path for path, _ in stand.builds] == [cache]  # in place: its directory is ours
    good = hashlib.sha256(stand.good).hexdigest()
    assert stand.loads == [(str(cache), good)]  # only ever the rebuilt bytes
    assert not cache.is_symlink() and os.stat(cache).st_uid == os.geteuid()
    assert build._recorded_digest(cache) == good
    assert f"not loading {cache}" in caplog.text and "building it again" in caplog.text


def loosen(copy: Path, how: str) -> None:
    directory, root = copy.parent, copy.parent.parent
    if how == "group-writable directory":
        os.chmod(directory, 0o775)
    elif how == "world-writable directory":
        os.chmod(directory, 0o777)
    elif how == "sticky world-writable directory":  # sticky or not: ours alone
        os.chmod(directory, 0o1777)
    elif how == "directory of another owner":
        os.chown(directory, OTHER_UID, OTHER_UID)
    elif how == "world-writable cache root":  # anyone could swap cpu_kernels/ out
        os.chmod(root, 0o777)
    elif how == "cache root of another owner":
        os.chown(root, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize("how", ["group-writable directory", "world-writable directory",
                                 "sticky world-writable directory",
                                 "directory of another owner", "world-writable cache root",
                                 "cache root of another owner"])
def test_a_cache_others_may_write_is_not_used_a_private_copy_is_built(cache, stand, how,
                                                                      caplog):
    if "another owner" in how and os.geteuid() != 0:
        pytest.skip("giving a directory to another user takes root")
    loosen(cache, how)
    before = cache.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvserve.cpu_kernels"):
        loaded = build.load_kernels(cache.parent.parent)
    [(private, mode)] = stand.builds
    assert private.parent != cache.parent and mode == 0o700  # mkdtemp's
    assert stand.loads == [(str(private), hashlib.sha256(stand.good).hexdigest())]
    assert loaded == private and not private.parent.exists()  # removed once loaded
    assert cache.read_bytes() == before  # the shared cache left as it was
    assert "Building a private copy" in caplog.text and "chmod go-w" in caplog.text


def test_a_sticky_directory_above_the_cache_is_fine(tmp_path, library, stand):
    """As /tmp is: in a sticky directory no one may rename what is not theirs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    root = shared / "cache"
    copy = build.library_path(root, build.c_compiler())
    copy.parent.mkdir(parents=True)
    for d in (root, copy.parent):
        os.chmod(d, 0o755)
    copy_library(library, copy)
    assert build.load_kernels(root) == copy and stand.builds == []
    os.chmod(shared, 0o777)  # not sticky: refused
    assert build.load_kernels(root) != copy and len(stand.builds) == 1


def test_a_new_cache_is_created_writable_by_no_one_else(tmp_path, stand):
    old = os.umask(0o002)
    try:
        path = build.load_kernels(tmp_path / "new-cache")
    finally:
        os.umask(old)
    assert path.parent == tmp_path / "new-cache" / "cpu_kernels"
    assert [p for p, _ in stand.builds] == [path]
    for d in (path.parent, path.parent.parent):
        assert os.stat(d).st_mode & 0o022 == 0
    assert stand.loads == [(str(path), hashlib.sha256(stand.good).hexdigest())]
