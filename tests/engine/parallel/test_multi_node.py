"""Tensor parallelism over two "nodes" on one machine: node 1 is a separate process
tree (`kvserve serve --headless`, its own session), started by its own command, and
both meet at node 0's TCP rendezvous on loopback; greedy output is token-identical
to one process, through chunked prefill, prefix hits and a fork, with the steps
broadcast rather than shared through /dev/shm. Node 1 ends cleanly when node 0
stops or on SIGTERM, and with an error when node 0 dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.ranks import step_channel
from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS
from kvserve.engine.platform.device import cpu_flags
from tests.engine.parallel.test_tensor_parallel import assert_same_as_one_rank
from tests.support.server import free_port

# What tests/conftest.py gives the in-process engines, said to node 1 outright.
KERNELS = "kvserve" if set(NEEDED_FLAGS) <= cpu_flags() else "torch"


def headless(model_dir, port: int, *extra: str, split=("--tensor-parallel-size", "2"),
             **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve", "--headless",
         "--model", str(model_dir), *split, "--nnodes", "2",
         "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--dtype", "float32", "--device", "cpu", "--compile", "off",
         "--cpu-kernels", KERNELS, "--num-kv-blocks", "256",
         "--max-num-batched-tokens", "64", *extra],
        start_new_session=True, **popen)  # its own process tree, as on another host


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_two_nodes_on_loopback_match_one_process(tiny_model_dir, monkeypatch):
    sent = []
    send = step_channel.StepChannel.send
    monkeypatch.setattr(step_channel.StepChannel, "send",
                        lambda self, *a: sent.append(self.networked) or send(self, *a))
    model_dir = tiny_model_dir("llama")
    port = free_port()
    node1 = headless(model_dir, port)
    try:
        assert_same_as_one_rank(model_dir, 2, vocab=300, nnodes=2, master_port=port,
                                master_addr="127.0.0.1", cpu_kernels=KERNELS)
        assert node1.wait(60) == 0  # node 0 stopped its engine: node 1 ends cleanly
    finally:
        stop(node1)
    assert sent and all(sent)  # every step by broadcast, none through /dev/shm


def test_two_pipeline_stages_on_two_nodes_match_one_process(tiny_model_dir):
    """P=2 over two nodes: node 1 runs the first stage (global rank 1), node 0 the
    engine's last; the steps and hidden states cross the hosts point to point."""
    from tests.engine.parallel.test_pipeline_parallel import assert_same_as_one_process

    model_dir = tiny_model_dir("llama")
    port = free_port()
    node1 = headless(model_dir, port, split=("--pipeline-parallel-size", "2"))
    try:
        assert_same_as_one_process(model_dir, 2, vocab=300, cpu_kernels=KERNELS,
                                   staged={"nnodes": 2, "master_port": port,
                                           "master_addr": "127.0.0.1"})
        assert node1.wait(60) == 0
    finally:
        stop(node1)


def test_flags_that_do_not_fit_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="does not divide"):
        EngineConfig(model="m", tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="does not divide"):
        EngineConfig(model="m", pipeline_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="node-rank 2"):
        EngineConfig(model="m", tensor_parallel_size=2, nnodes=2, node_rank=2)
    model_dir = tiny_model_dir("llama")
    no_port = subprocess.run(
        [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve", "--headless",
         "--model", str(model_dir), "--tensor-parallel-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--device", "cpu"], capture_output=True, text=True,
        timeout=120, env={k: v for k, v in os.environ.items() if k != "MASTER_PORT"})
    assert no_port.returncode != 0 and "needs --master-port" in no_port.stderr
    node0 = subprocess.run(
        [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve", "--headless",
         "--model", str(model_dir), "--device", "cpu"], capture_output=True, text=True,
        timeout=120)
    assert node0.returncode != 0 and "runs a node other than 0" in node0.stderr


def test_node_1_waiting_for_node_0_stops_on_sigterm(tiny_model_dir):
    node1 = headless(tiny_model_dir("llama"), free_port(), stderr=subprocess.PIPE,
                     text=True)
    try:
        deadline = time.monotonic() + 120
        for line in node1.stderr:  # its rank started, and waits at the rendezvous
            if "rendezvous at" in line:
                break
            assert time.monotonic() < deadline
        assert node1.poll() is None
        node1.terminate()  # SIGTERM: the ranks are stopped first
        node1.communicate(timeout=30)  # (drained: its ranks log to the same pipe)
        assert node1.returncode == 0
    finally:
        stop(node1)


def test_node_1_exits_non_zero_when_node_0_dies(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    port, http = free_port(), free_port()
    node1 = headless(model_dir, port)
    node0 = subprocess.Popen(
        [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve",
         "--model", str(model_dir), "--tensor-parallel-size", "2", "--nnodes", "2",
         "--master-port", str(port), "--dtype", "float32", "--device", "cpu",
         "--compile", "off", "--cpu-kernels", KERNELS, "--num-kv-blocks", "256",
         "--port", str(http)], start_new_session=True)
    try:
        url = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert time.monotonic() < deadline and node0.poll() is None
            time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={
            "model": str(model_dir), "prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text  # both nodes' ranks ran its steps
        os.killpg(node0.pid, signal.SIGKILL)
        assert node1.wait(60) != 0  # its rank lost node 0's: a supervisor restarts it
    finally:
        stop(node0)
        stop(node1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
