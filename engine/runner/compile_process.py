"""What compiling means to the whole process: where Inductor's and Triton's caches
live, the background builds still running at exit (which cannot be stopped), and how
many graphs Dynamo has built."""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("kvserve.compile")


def use_cache_dir(root: str) -> None:
    """Inductor's and Triton's on-disk caches under `root`, unless the user chose
    (torch itself sets TORCHINDUCTOR_CACHE_DIR to its default the first time it
    looks: that one is replaced)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not inductor or inductor == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")


_builders: list[threading.Thread] = []  # background builds of this process


def track_build(thread: threading.Thread) -> None:
    """A background build, for exit_if_compiling."""
    _builders.append(thread)


def exit_if_compiling(code: int = 0) -> None:
    """Ends the process at once (os._exit) if a background build is still running:
    a compiler thread cannot be stopped, and tearing the interpreter down under it
    crashes (a C++ terminate or a segfault) instead of exiting. Called last, once
    everything else has shut down."""
    if any(t.is_alive() for t in _builders):
        log.info("exiting while the forward pass was still compiling")
        logging.shutdown()
        os._exit(code)


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
