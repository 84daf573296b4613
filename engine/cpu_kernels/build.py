"""The kernels (this folder's *.cpp, and the *.h they include) built into one shared
library the first time they are needed on a machine, kept under
$KVSERVE_CACHE/cpu_kernels, and loaded into torch's operator registry
(`torch.ops.kvserve.packed_linear`, `.paged_decode`, `.paged_prefill`).

The library's name is a hash of everything that shapes it (the sources and headers,
the flags, the compiler, torch's version), so a change builds a new one beside the old. It is
compiled to a file of this process's own and renamed into place, which is atomic:
processes starting together (test workers, tensor-parallel ranks) may each build it,
but none waits on a lock that a killed one left behind, and none loads half a file.
torch.utils.cpp_extension.load would take a lock file for that, and a process
killed while building leaves it behind for every later start to wait on."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger("kvserve.cpu_kernels")

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources
# AVX2, FMA and F16C only (every AVX2 CPU has F16C): the library runs on any x86-64
# CPU that has them, whichever machine built it (a container image built on one host
# runs on others).
FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC",
         "-Wno-unused-parameter")


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
    return [compiler, *FLAGS, "-c", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in cpp_extension.include_paths()), str(source), "-o", str(obj)]


def _link_command(compiler: str, objs: list[Path], out: Path) -> list[str]:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    return [compiler, "-shared", "-fopenmp", *map(str, objs), "-o", str(out),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
            "-lc10", "-ltorch_cpu", "-ltorch"]


def library_path(cache_root: Path, compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in (*SOURCES, *HEADERS)), " ".join(FLAGS).encode(),
                 compiler.encode(), torch.__version__.encode(), sys.version.encode()):
        key.update(part)
    return cache_root / "cpu_kernels" / f"kernels-{key.hexdigest()[:16]}.so"


def load_kernels(cache_root: Path) -> Path:
    """Builds the library if this machine has none yet, loads it, and returns its
    path. Raises BuildError saying why it cannot. (Load it once a process:
    setup.load_once.)"""
    compiler = c_compiler()
    if compiler is None:
        raise BuildError("no C++ compiler found (g++ or $CXX)")
    path = library_path(cache_root, compiler)
    if not path.exists():
        _build(compiler, path)
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        raise BuildError(f"loading {path} failed: {exc}") from exc
    global _loaded
    _loaded = True
    return path


def _build(compiler: str, path: Path) -> None:
    """Each source compiled at once beside the others (the cores build it in about
    the time of the largest), then linked; every file is this process's own until
    the library is renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    own = f"{os.getpid()}.tmp"
    objs = [path.with_name(f".{path.stem}.{s.stem}.{own}.o") for s in SOURCES]
    partial = path.with_name(f".{path.name}.{own}")
    log.info("building kvserve's CPU kernels once for this machine -> %s", path)
    try:
        compiling = [subprocess.Popen(_compile_command(compiler, s, o), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                     for s, o in zip(SOURCES, objs)]
        for source, proc in zip(SOURCES, compiling):
            output = proc.communicate()[0]
            if proc.returncode != 0:
                raise BuildError(f"{compiler} failed to build {source.name}:\n"
                                 f"{output.strip()[-2000:]}")
        done = subprocess.run(_link_command(compiler, objs, partial), capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed to link the kernels:\n"
                             f"{done.stderr.strip()[-2000:]}")
        os.replace(partial, path)
    finally:
        for leftover in (*objs, partial):
            leftover.unlink(missing_ok=True)
