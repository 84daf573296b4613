"""Starts the process that builds the forward pass's graph packages
(engine/runner/graph_packages.py; the process's program: package_builder.py) and
waits for it, while the serving process runs eager steps.

Why a process: exporting a graph (torch.export) swaps patches into torch and the
model's modules process-wide, so it cannot run beside eager steps of the same model,
and compiling in the serving process held its GIL for tens of seconds at a time (a
16-token answer took 19-59 s then: bench/results/startup_cpu_2026-11-29.md). The
child runs at a lower CPU priority than the serving process.

Kept apart from the program, which builds an Engine: the engine's build starts
this process, so importing the program from there would be a cycle."""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Far below the serving process (niceness 0), so its steps come first on shared
# cores (and the compiler processes the build starts inherit it). At 10, 16-token
# answers took up to 1.7x the idle eager server's while the build ran on 2 cores.
NICENESS = 19
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _below_and_bound_to_parent() -> None:
    """In the child before it starts: a lower priority, and killed with its parent
    (a server stopped or crashed mid-build leaves no build running; Linux only)."""
    os.nice(NICENESS)
    if sys.platform == "linux":
        # SCHED_IDLE: only on a core nothing else wants, and preempted as soon as a
        # serving thread wakes (niceness 19 alone still takes a slice of a busy core).
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def build_in_child(config, root: Path) -> None:
    """Builds the packages of `config`'s model under `root` in a child process and
    waits for it (the caller's thread only: its GIL is released while it waits).
    Raises RuntimeError if the child fails."""
    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
        pickle.dump(config, f)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvserve.engine.core.package_builder",
                               f.name, str(root)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=_below_and_bound_to_parent, check=False)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace")[-2000:]
        raise RuntimeError(f"the graph build process exited {proc.returncode}: {tail}")
