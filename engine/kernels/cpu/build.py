"""The kernels (this folder's *.cpp, and the *.h they include) built into one shared
library the first time they are needed on a machine, kept under
$KVSERVE_CACHE/cpu_kernels, and loaded into torch's operator registry
(`torch.ops.kvserve.packed_linear`, `.paged_decode`, `.paged_prefill`).

The library's name is a hash of everything that shapes it (the sources and headers,
the flags, the compiler, torch's version), so a change builds a new one beside the old. It is
compiled to a file of this process's own and renamed into place, which is atomic:
none loads half a file. Processes starting together (a server's early build and its
engine, test workers, tensor-parallel ranks) wait for a live one's build, marked by a
file named after its pid; a killed builder's mark is not waited for, so none waits
on a lock that a killed one left behind.
torch.utils.cpp_extension.load would take a lock file for that, and a process
killed while building leaves it behind for every later start to wait on.

Loading a library runs its code in this process, and its name is computed from
public inputs: before loading one from the cache, its directory must be this user's
and writable by no one else (and each directory above it this user's or root's,
writable by no one else unless sticky, as /tmp is), the file this user's and
writable by no one else, and its SHA-256 the one recorded beside it
(kernels-*.so.sha256, written when it was built). A library that fails its own
checks is built again in place; a cache directory that fails them is not used at
all (see load_kernels)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve.engine.kernels.cpu.other_builds import build_mark, wait_for_other_builds
from kvserve.engine.platform.device import cpu_flags

log = logging.getLogger("kvserve.cpu_kernels")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources
# The sources compiled as two translation units side by side, each including its
# sources in turn: torch's headers (4.5 s of each source's 6-10 s on a Zen 4, 6.5 of
# 9-26 on an AVX2 Zen 3) are then parsed twice, not six times. The units are split by
# compile time, which a cold start waits for: packed_gemm.cpp alone (26 s on that
# Zen 3) and the rest (28 s); attention / the other GEMMs and the experts took 12 and
# 31 s, the build's wall time that much longer.
OWN_UNIT = "packed_gemm.cpp"
UNITS = {"packed_gemm": tuple(s for s in SOURCES if s.name == OWN_UNIT),
         "others": tuple(s for s in SOURCES if s.name != OWN_UNIT)}
# AVX2, FMA and F16C only (every AVX2 CPU has F16C): the library runs on any x86-64
# CPU that has them, whichever machine built it (a container image built on one host
# runs on others; one built without AVX-512's kernels, isa_flags, takes none there).
# Symbols hidden but the ops' C entry points (c_shims.py): the library is loaded
# RTLD_GLOBAL, and its copies of torch's inline functions must not stand in for
# another library's.
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC",
         "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-Wno-unused-parameter")


def isa_flags(flags: set[str] | None = None) -> tuple[str, ...]:
    """Without AVX-512F here (or in `flags`), no AVX-512 kernels (isa_built.h): a first
    start waits for the build, 25.8 -> 15.8 s on a 2-core AVX2 Zen 3. In the library's
    name: a CPU with AVX-512 sharing the cache builds the whole library for itself."""
    flags = cpu_flags() if flags is None else flags
    return () if "avx512f" in flags else ("-DKVSERVE_AVX512_BUILT=0",)


_loaded = False  # by this process (setup.load_once)


def loaded() -> bool:
    """Whether this process has the kernels: their ops exist."""
    return _loaded


class BuildError(RuntimeError):
    """The kernels cannot be built or loaded here (the message says why)."""


def c_compiler() -> str | None:
    """The C++ compiler Inductor would use on CPU, if one is installed."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _compile_command(compiler: str, source: Path, obj: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, *FLAGS, *isa_flags(), "-c", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(obj)]


def _link_command(compiler: str, objs: list[Path], out: Path) -> list[str]:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    return [compiler, "-shared", "-fopenmp", *map(str, objs), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch_cpu", "-ltorch"]


def library_path(cache_root: Path, compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in (*SOURCES, *HEADERS)),
                 " ".join(FLAGS + isa_flags()).encode(),
                 compiler.encode(), torch.__version__.encode(), sys.version.encode()):
        key.update(part)
    return cache_root / "cpu_kernels" / f"kernels-{key.hexdigest()[:16]}.so"


def load_kernels(cache_root: Path) -> Path:
    """Builds the library if this machine has none yet (or none that passes the
    checks above), loads it, and returns its path. Raises BuildError saying why it
    cannot. (Load it once a process: setup.load_once.)"""
    compiler, path = _compiler_and_path(cache_root)
    unsafe = _unsafe_directory(path.parent)
    if unsafe is not None:
        # Anyone who can write there can put their own library under this name.
        # Rather than refuse (a cache shared with, or left behind by, another user
        # would then stop kvserve from starting), build a private copy for this
        # process: slower to start, as safe, and the warning says what to fix.
        log.warning("not loading kvserve's CPU kernels from %s: %s. Building a private "
                    "copy for this process instead; make the directory this user's and "
                    "writable by no one else (chown, chmod go-w) or set KVSERVE_CACHE "
                    "to a private one to build it once", path.parent, unsafe)
        return _load_private(compiler, path.name)
    _build_if_needed(compiler, path)
    _load_library(path)
    return path


def ensure_built(cache_root: Path) -> Path | None:
    """The library built under cache_root, without loading it, if this machine has
    none yet (or none that passes the checks above): so a server can build it while
    it converts its model, before its engine loads it. None where the cache is not
    to be trusted (load_kernels then builds a private copy)."""
    compiler, path = _compiler_and_path(cache_root)
    if _unsafe_directory(path.parent) is not None:
        return None
    _build_if_needed(compiler, path)
    return path


def _compiler_and_path(cache_root: Path) -> tuple[str, Path]:
    compiler = c_compiler()
    if compiler is None:
        raise BuildError("no C++ compiler found (g++ or $CXX)")
    path = library_path(cache_root, compiler)
    try:
        _make_dirs(path.parent)
    except OSError as exc:
        raise BuildError(f"cannot create {path.parent}: {exc}") from exc
    return compiler, path


def _build_if_needed(compiler: str, path: Path) -> None:
    """In a directory of this user's alone (checked): a library missing or failing
    its checks is built, in its place."""
    if not path.exists():
        wait_for_other_builds(path)
    built = None
    if not path.exists():
        built = _build(compiler, path)
    elif (problem := _check_library(path, _recorded_digest(path))) is not None:
        log.warning("not loading %s: %s; building it again", path, problem)
        built = _build(compiler, path)
    if built is not None and (problem := _check_library(path, built)) is not None:
        raise BuildError(f"the library just built at {path} fails its checks: {problem}")


def _load_private(compiler: str, name: str) -> Path:
    """Builds the library into a fresh directory of this process's own (mkdtemp:
    mode 0700), loads it, and removes the directory (the loaded library stays
    mapped)."""
    private = Path(tempfile.mkdtemp(prefix="kvserve-cpu-kernels-"))
    try:
        path = private / name
        unsafe = _unsafe_directory(private)  # ($TMPDIR's own chain)
        if unsafe is not None:
            raise BuildError(f"no safe directory to build the CPU kernels in: {unsafe}")
        problem = _check_library(path, _build(compiler, path))
        if problem is not None:
            raise BuildError(f"the library built at {path} fails its checks: {problem}")
        _load_library(path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return path


def _load_library(path: Path) -> None:
    try:
        _open(path)
    except OSError as exc:
        raise BuildError(f"loading {path} failed: {exc}") from exc
    global _loaded
    _loaded = True


def _open(path: Path) -> None:
    """dlopen: the ops registered with torch, then the library's symbols made global
    (RTLD_NOLOAD: the copy torch just loaded, never a second one, whose static
    initialisers would register the ops again and abort), because a graph package's
    library calls the ops' C entry points by name (c_shims.py)."""
    torch.ops.load_library(str(path))
    ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)


def _make_dirs(directory: Path) -> None:
    """mkdir -p, each new directory writable by its owner alone whatever the umask
    (Path.mkdir(parents=True) gives the parents the umask's mode: 0775 under a
    umask of 002, which the checks would refuse)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o755)
        except FileExistsError:  # another process's, just now
            pass


def _unsafe_directory(directory: Path) -> str | None:
    """Why a library in `directory` could be someone else's, or None. The directory
    must be this user's and writable by no one else; each one above it this user's
    or root's, and writable by no one else unless sticky (in a sticky directory no
    one may rename or remove what is not theirs, so the path below it holds)."""
    me = os.geteuid()
    real = Path(os.path.realpath(directory))
    for d in (real, *real.parents):
        st = os.stat(d)
        mode = stat.S_IMODE(st.st_mode)
        if d == real and st.st_uid != me:
            return f"{d} is owned by uid {st.st_uid}, not this user (uid {me})"
        if st.st_uid not in (me, 0):
            return f"{d} is owned by uid {st.st_uid}, neither this user (uid {me}) nor root"
        if mode & 0o022 and (d == real or not mode & stat.S_ISVTX):
            return f"{d} is writable by its group or others (mode {mode:04o})"
    return None


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _recorded_digest(path: Path) -> str | None:
    """The SHA-256 recorded when `path` was built (sha256sum's format), or None."""
    try:
        fd = os.open(_digest_path(path), os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        words = f.read(200).split()
    return words[0] if words and len(words[0]) == 64 else None


def _sha256(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _check_library(path: Path, digest: str | None) -> str | None:
    """Why the library at `path` must not be loaded, or None: it must be a regular
    file (not a symlink) of this user's, writable by no one else, with the SHA-256
    `digest`."""
    if digest is None:
        return "no SHA-256 was recorded for it (built by an older kvserve?)"
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as exc:
        return f"it cannot be opened ({exc.strerror})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return "it is not a regular file"
        if st.st_uid != os.geteuid():
            return f"it is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})"
        if st.st_mode & 0o022:
            return (f"it is writable by its group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):04o})")
        if _sha256(f) != digest:
            return "its SHA-256 is not the one recorded when it was built"
    return None


def _install(partial: Path, path: Path) -> str:
    """Moves a finished library into place and records its SHA-256 beside it, both
    renamed into place (atomic); returns the digest. The library is made 0755
    whatever the umask (one that lets the group write would fail the checks)."""
    os.chmod(partial, 0o755)
    with open(partial, "rb") as f:
        digest = _sha256(f)
    record = path.with_name(f".{path.name}.sha256.{os.getpid()}.tmp")
    record.unlink(missing_ok=True)  # left by a killed process of the same pid
    try:
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}  {path.name}\n")
        os.replace(partial, path)
        os.replace(record, _digest_path(path))
    finally:
        record.unlink(missing_ok=True)
    return digest


def _build(compiler: str, path: Path) -> str:
    """Each unit compiled at once beside the other, then linked; every file is this
    process's own until the library is renamed into place. Returns the library's
    SHA-256."""
    _make_dirs(path.parent)
    own = f"{os.getpid()}.tmp"
    units = {name: path.with_name(f".{path.stem}.{name}.{own}.cpp") for name in UNITS}
    objs = [unit.with_suffix(".o") for unit in units.values()]
    partial = path.with_name(f".{path.name}.{own}")
    marker = build_mark(path)
    log.info("building kvserve's CPU kernels once for this machine -> %s", path)
    start = time.monotonic()
    marker.touch()
    try:
        for name, unit in units.items():
            unit.write_text("".join(f'#include "{s}"\n' for s in UNITS[name]))
        compiling = [subprocess.Popen(_compile_command(compiler, u, o), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                     for u, o in zip(units.values(), objs)]
        for name, proc in zip(units, compiling):
            output = proc.communicate()[0]
            if proc.returncode != 0:
                raise BuildError(f"{compiler} failed to build "
                                 f"{', '.join(s.name for s in UNITS[name])}:\n"
                                 f"{output.strip()[-2000:]}")
        done = subprocess.run(_link_command(compiler, objs, partial), capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed to link the kernels:\n"
                             f"{done.stderr.strip()[-2000:]}")
        digest = _install(partial, path)
        log.info("built kvserve's CPU kernels in %.1f s", time.monotonic() - start)
        return digest
    finally:
        for leftover in (*units.values(), *objs, partial, marker):
            leftover.unlink(missing_ok=True)
