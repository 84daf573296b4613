"""`kvserve` asks torch for transparent huge pages for its weights
(cli.huge_pages_for_weights: THP_MEM_ALLOC_ENABLE, read by torch once, at import),
unless the caller said otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.server.entrypoints import cli

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# A 64 MiB tensor, written, in a process that called huge_pages_for_weights before
# importing torch: its huge pages (kB) as the kernel counts them.
PROBE = """
from kvserve.server.entrypoints.cli import huge_pages_for_weights
huge_pages_for_weights()
import re, torch
t = torch.ones(16 * 2**20)
rollup = open("/proc/self/smaps_rollup").read()
print(int(re.search(r"AnonHugePages:\\s+(\\d+)", rollup)[1]))
"""


def test_set_unless_the_caller_chose(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    cli.huge_pages_for_weights()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    cli.huge_pages_for_weights()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def _huge_kib(**env) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text()
                    or not Path("/proc/self/smaps_rollup").exists(),
                    reason="no transparent huge pages on this machine")
def test_torch_puts_large_tensors_in_huge_pages():
    assert _huge_kib() >= 2048
    if "[madvise]" in THP_MODE.read_text():  # (in `always` mode every process gets them)
        assert _huge_kib(THP_MEM_ALLOC_ENABLE="0") == 0
