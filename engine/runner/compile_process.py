"""What compiling means to the whole process: where Inductor's and Triton's caches
live, the background builds still running at exit (which cannot be stopped), and how
many graphs Dynamo has built."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from kvserve.engine.runner import inductor_cache

log = logging.getLogger("kvserve.compile")


# The sources that declare kvserve's custom ops (the Python ones and the CPU
# library's). A compiled graph calls an op through the schema it was compiled
# against, and Inductor's cache key does not cover our schemas: a graph cached
# before an op gained an argument segfaults when loaded after (seen: a warm cache
# from before fused_experts took int8 scales). So the cache is per version of them.
OP_SOURCES = ("kernels/attention/context.py", "kernels/attention/latent.py",
              "kernels/moe/fused_experts.py",
              "models/lora_step.py", "kernels/cpu/packed_gemm.cpp",
              "kernels/cpu/bf16_pairs.cpp",
              "kernels/cpu/paged_decode.cpp", "kernels/cpu/paged_prefill.cpp")


def ops_key() -> str:
    """A short hash of OP_SOURCES as they are in this installation."""
    engine = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in OP_SOURCES:
        digest.update(name.encode())
        digest.update((engine / name).read_bytes())
    return digest.hexdigest()[:12]


def use_cache_dir(root: str, budget: int | None = None) -> None:
    """Inductor's and Triton's on-disk caches under `root`, Inductor's per version
    of kvserve's op schemas (ops_key), unless the user chose (torch itself sets
    TORCHINDUCTOR_CACHE_DIR to its default the first time it looks: that one is
    replaced). A folder of kvserve's own is kept within `budget` bytes, and other
    versions' folders are removed (inductor_cache.py), now and by trim_cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    global _owned
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not inductor or inductor == default_cache_dir() \
            or Path(inductor).parent == Path(root, "inductor"):
        folder = Path(root, "inductor", ops_key())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        if budget is not None:
            since = _owned[2] if _owned and _owned[0] == folder else time.time()
            _owned = (folder, budget, since)
            inductor_cache.mark_used(folder)
            inductor_cache.remove_other_versions(folder)
            trim_cache()
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")


# (folder, budget, since): the Inductor cache folder use_cache_dir chose, its budget,
# and when this process began using it (what it has used since is never removed).
_owned: tuple[Path, int, float] | None = None


def trim_cache() -> None:
    """Keeps the Inductor cache folder use_cache_dir chose within its budget."""
    if _owned is not None:
        folder, budget, since = _owned
        inductor_cache.trim(folder, budget, since)


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
