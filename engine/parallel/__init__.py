"""Tensor parallelism (--tensor-parallel-size): which part of the model a rank holds
and reads from the checkpoint (shard.py), the layers and collectives that join the
parts (layers.py, comm.py), rank 0's group of worker processes (group.py, worker.py)
and the shared-memory channel each step reaches them through (step_channel.py)."""
