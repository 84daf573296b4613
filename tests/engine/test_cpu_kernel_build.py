"""Building the CPU kernels off a cold start's path: a server builds them on a thread
of its own at the lowest priority while it converts its model, and the engine's load
waits for a live process's build instead of starting a second one (a killed
builder's mark is not waited for)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from kvserve.engine.kernels.cpu import build, other_builds
from kvserve.engine.weights import cpu_packing


def _mark(path, pid: int):
    marker = path.with_name(f".{path.name}.{pid}.building")
    marker.touch()
    return marker


def test_a_live_builders_library_is_waited_for(tmp_path):
    path = tmp_path / "kernels-x.so"
    other_builds.build_mark(path).touch()  # this process's: alive
    threading.Timer(0.5, path.write_bytes, args=(b"built",)).start()
    start = time.monotonic()
    other_builds.wait_for_other_builds(path)
    assert path.exists() and 0.4 < time.monotonic() - start < 10


def test_a_dead_builders_mark_is_not_waited_for(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "kernels-x.so"
    _mark(path, gone.pid)
    _mark(path.with_name("kernels-other.so"), os.getpid())  # another library's build
    assert other_builds._builders(path) == []
    start = time.monotonic()
    other_builds.wait_for_other_builds(path)
    assert not path.exists() and time.monotonic() - start < 1


def test_a_build_that_never_ends_is_waited_for_only_so_long(tmp_path, monkeypatch):
    monkeypatch.setattr(other_builds, "BUILD_WAIT_S", 0.3)
    path = tmp_path / "kernels-x.so"
    _mark(path, os.getpid())
    start = time.monotonic()
    other_builds.wait_for_other_builds(path)
    assert 0.3 <= time.monotonic() - start < 5


def test_each_unit_takes_its_sources_once():
    units = [s for unit in build.UNITS.values() for s in unit]
    assert sorted(units) == sorted(build.SOURCES)
    assert [s.name for s in build.UNITS["packed_gemm"]] == [build.OWN_UNIT]


def test_a_cpu_without_avx512_builds_the_library_without_its_kernels(monkeypatch, tmp_path):
    """KVSERVE_AVX512_BUILT=0 where the CPU has no AVX-512F, and the library then has a
    name of its own: a cache shared with a CPU that has it builds the whole one there."""
    assert build.isa_flags({"avx2", "fma", "f16c"}) == ("-DKVSERVE_AVX512_BUILT=0",)
    assert build.isa_flags({"avx2", "fma", "f16c", "avx512f"}) == ()
    names = set()
    for flags in ({"avx2"}, {"avx2", "avx512f"}):
        monkeypatch.setattr(build, "cpu_flags", lambda flags=flags: flags)
        names.add(build.library_path(tmp_path, "g++").name)
    assert len(names) == 2


def test_the_variant_this_cpu_does_not_build_compiles_too(monkeypatch, tmp_path):
    """A CPU builds one of the two variants (isa_flags); the other's sources, all in one
    unit, pass the compiler's checks here too (types, names, every template's
    instance: -fsyntax-only, a third of a build's time), so an edit to either is
    caught on any machine."""
    compiler = build.c_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    here = build.cpu_flags()
    other = here - {"avx512f"} if "avx512f" in here else here | {"avx512f"}
    monkeypatch.setattr(build, "cpu_flags", lambda: other)
    unit = tmp_path / "all.cpp"
    unit.write_text("".join(f'#include "{s}"\n' for s in build.SOURCES))
    command = build._compile_command(compiler, unit, tmp_path / "all.o")
    command = [a for a in command[:command.index("-o")] if a != "-c"] + ["-fsyntax-only"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_background_build_runs_at_the_lowest_priority(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_packing, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    seen = {}

    def ensure_built(root):
        seen["root"] = root
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        raise build.BuildError("no compiler")  # left for the engine's load to report

    monkeypatch.setattr(cpu_packing, "ensure_built", ensure_built)
    thread = cpu_packing.build_in_background("auto", "cpu")
    thread.join(10)
    assert seen == {"root": tmp_path, "nice": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # ours kept


@pytest.mark.parametrize("mode, device, flags", [
    ("torch", "cpu", {"avx2", "fma", "f16c"}),  # torch's kernels wanted
    ("auto", "cpu", {"avx2"}),  # a CPU the kernels cannot run on
    ("auto", "cuda", {"avx2", "fma", "f16c"}),  # no CUDA here: the engine says so
])
def test_no_background_build_where_the_engine_wants_no_kernels(monkeypatch, mode, device,
                                                               flags):
    monkeypatch.setattr(cpu_packing, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_packing, "ensure_built", pytest.fail)
    assert cpu_packing.build_in_background(mode, device) is None
