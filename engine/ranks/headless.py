"""`kvserve serve --headless` on a node other than 0 (--node-rank > 0): this host's
share of the ranks (tensor-parallel ranks, and pipeline stages' with
--pipeline-parallel-size: world_size / nnodes of them), started as node 0 starts its
own (launch.py), joined at node 0's rendezvous, and watched until they end. No HTTP,
no scheduler: node 0's engine drives every step.

Exit code: 0 once every rank has ended cleanly (node 0 stopped its engine), else the
first failure's (a rank died, or lost node 0): a supervisor restarts the node, as
it restarts a server whose engine died. SIGTERM stops the ranks first."""
from __future__ import annotations

import logging
import signal
import subprocess
import time

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.platform.device import resolve_device, resolve_dtype
from kvserve.engine.ranks.launch import ranks_per_node, rendezvous, spawn_workers, world_size

log = logging.getLogger("kvserve.headless")


def run_headless(config: EngineConfig) -> int:
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError("--headless runs a node other than 0: give --nnodes (2 or more) "
                         "and --node-rank (1 or more)")
    stopping = []  # SIGTERM from here on stops the ranks first, then exits 0
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    model_config = ModelConfig.from_pretrained(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = config.context_cap(model_config)
    addr, port = rendezvous(config)
    per_node = ranks_per_node(config)
    first = config.node_rank * per_node
    ranks = range(first, first + per_node)
    procs = spawn_workers(config, ranks, addr, port, "kvserve-headless", device, dtype,
                          max_model_len)
    log.info("node %d of %d: ranks %d-%d of %d, rendezvous at %s:%d", config.node_rank,
             config.nnodes, ranks[0], ranks[-1], world_size(config), addr, port)
    try:
        return _watch(procs, ranks, stopping)
    finally:
        _stop(procs)


def _watch(procs: list[subprocess.Popen], ranks: range, stopping: list) -> int:
    while not stopping:
        codes = [p.poll() for p in procs]
        for rank, code in zip(ranks, codes):
            if code:  # not None and not 0
                log.error("rank %d exited with code %d: this node stops", rank, code)
                return code
        if all(code == 0 for code in codes):
            log.info("every rank of this node ended: node 0 stopped")
            return 0
        time.sleep(0.2)
    return 0


def _stop(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
