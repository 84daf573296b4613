"""The program of the graph build process (package_build_process.py starts it):
builds the same model from the serving process's EngineConfig with a small KV cache
(the packages fit any number of blocks), builds every graph's package under the same
keys (engine/runner/graph_packages.py) and exits; the serving process then loads them.

    python -m kvserve.engine.core.package_builder CONFIG.pickle ROOT"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from pathlib import Path

from kvserve.engine.core.engine import Engine
from kvserve.engine.runner.compile_process import trim_cache, use_cache_dir
from kvserve.engine.runner.graph_packages import KINDS
from kvserve.modelstore.default_model import cache_root

log = logging.getLogger("kvserve.compile")

# The child's KV cache: the warm-up steps need a block and a spare; a package's
# cache inputs have a dynamic number of blocks.
BUILD_BLOCKS = 16


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    config_path, root = argv
    config = pickle.loads(Path(config_path).read_bytes())
    config = dataclasses.replace(config, compile="off", num_kv_blocks=BUILD_BLOCKS,
                                 kv_cache_memory=None)
    use_cache_dir(str(cache_root()), config.compile_cache_bytes)
    engine = Engine(config)
    compiled = engine.runner.compile_forward(background=False, packages=Path(root))
    built = set(compiled.packages.graphs) if compiled.packages is not None else set()
    trim_cache()
    if built != set(KINDS):
        log.error("packages built: %s of %s", sorted(built), list(KINDS))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
