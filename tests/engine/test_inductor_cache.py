"""Inductor's on-disk cache within its byte budget (engine/runner/inductor_cache.py):
least recently used files first, never what this process wrote, other kvserve
versions' folders once stale; and Inductor rebuilding what was removed, so a trimmed
cache still gives the same compiled results (checked on this torch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvserve.engine.runner import compile_process, inductor_cache


def write(path: Path, size: int, age_s: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_trim_removes_the_least_recently_used_files_until_within_budget(tmp_path):
    files = [write(tmp_path / sub / f"f{i}", 1000, age)
             for i, (sub, age) in enumerate([("aa", 400), ("bb", 300), ("aa", 200),
                                              ("cc", 100)])]
    freed = inductor_cache.trim(tmp_path, budget=2500, since=time.time())
    assert freed == 2000
    assert [f.exists() for f in files] == [False, False, True, True]
    assert not (tmp_path / "bb").exists()  # emptied folders go too
    assert inductor_cache.tree_bytes(tmp_path) == 2000
    assert inductor_cache.trim(tmp_path, budget=2500, since=time.time()) == 0


def test_a_file_read_recently_counts_as_used(tmp_path):
    old = write(tmp_path / "old", 1000, 400)
    read = write(tmp_path / "read", 1000, 500)
    stamp = time.time() - 10
    os.utime(read, (stamp, read.stat().st_mtime))  # accessed 10 s ago
    inductor_cache.trim(tmp_path, budget=1500, since=time.time())
    assert not old.exists() and read.exists()


def test_trim_keeps_what_this_process_wrote_even_past_the_budget(tmp_path):
    since = time.time() - 50
    earlier = write(tmp_path / "earlier", 1000, 100)
    mine = [write(tmp_path / f"mine{i}", 1000, 10) for i in range(3)]
    inductor_cache.trim(tmp_path, budget=1000, since=since)
    assert not earlier.exists()
    assert all(f.exists() for f in mine)


def test_other_versions_folders_go_once_stale(tmp_path):
    root = tmp_path / "inductor"
    current = root / "aaaa"
    inductor_cache.mark_used(current)
    stale = root / "bbbb"
    write(stale / "x" / "lib.so", 5000, 0)
    write(stale / inductor_cache.MARKER, 0, inductor_cache.STALE_S + 60)
    recent = root / "cccc"  # another version's server started minutes ago
    write(recent / "lib.so", 5000, 0)
    write(recent / inductor_cache.MARKER, 0, 120)
    unmarked = root / "dddd"  # from before the markers: its own time counts
    write(unmarked / "lib.so", 700, 0)
    os.utime(unmarked, (time.time() - 2 * inductor_cache.STALE_S,) * 2)
    assert inductor_cache.remove_other_versions(current) == 5700
    assert sorted(p.name for p in root.iterdir()) == ["aaaa", "cccc"]


def test_use_cache_dir_bounds_kvserves_own_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compile_process, "_owned", None)
    folder = tmp_path / "inductor" / compile_process.ops_key()
    old = write(folder / "ab" / "kernel.so", 3000, 1000)
    kept = write(folder / "cd" / "kernel.so", 1000, 500)
    stale = write(tmp_path / "inductor" / "0123456789ab" / "lib.so", 100, 0)
    os.utime(stale.parent, (time.time() - 2 * inductor_cache.STALE_S,) * 2)
    compile_process.use_cache_dir(str(tmp_path), budget=2000)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert not old.exists() and kept.exists() and not stale.parent.exists()
    # what this process writes later stays, however far past the budget
    later = write(folder / "ef" / "kernel.so", 5000, 0)
    compile_process.trim_cache()
    assert later.exists()


def test_a_user_chosen_cache_is_left_alone(tmp_path, monkeypatch):
    mine = tmp_path / "my-inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    monkeypatch.setattr(compile_process, "_owned", None)
    big = write(mine / "ab" / "kernel.so", 5000, 1000)
    compile_process.use_cache_dir(str(tmp_path / "kvserve"), budget=10)
    compile_process.trim_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine) and big.exists()


COMPILE = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    x, w = torch.randn(8, 64), torch.randn(64, 64)
    f = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w) * 2 + 1)
    out = f(x, w)
    print(json.dumps({"same": torch.equal(out, torch.nn.functional.silu(x @ w) * 2 + 1),
                      "hits": counters["inductor"]["fxgraph_cache_hit"]}))
""")


def compile_once(cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_trimmed_cache_still_gives_the_compiled_graph(tmp_path):
    """The files a trim takes first are the oldest; here the kernels' sources and
    libraries are made the oldest, so the graph's cache entry stays and refers to
    files that are gone: Inductor writes and builds them again."""
    cache = tmp_path / "inductor"
    assert compile_once(cache) == {"same": True, "hits": 0}
    entries = [p for p in inductor_cache._files(cache)
               if p.parts[len(cache.parts)] in ("fxgraph", "aotautograd")]
    kernels = [p for p in inductor_cache._files(cache)
               if p.suffix in (".so", ".py", ".cpp") and p not in entries]
    assert entries and kernels
    for age, group in ((1000, kernels), (10, entries)):
        for p in group:
            os.utime(p, (time.time() - age,) * 2)
    budget = inductor_cache.tree_bytes(cache) - sum(p.stat().st_size for p in kernels)
    inductor_cache.trim(cache, budget, since=time.time())
    assert not any(p.exists() for p in kernels) and all(p.exists() for p in entries)
    assert compile_once(cache) == {"same": True, "hits": 1}
    inductor_cache.trim(cache, 0, since=time.time() + 1)  # everything: a plain miss
    assert compile_once(cache) == {"same": True, "hits": 0}
