"""The other tensor-parallel ranks: rank 0's group of worker processes (group.py,
worker.py: a whole rank, loading its part and running the steps it is sent) and the
shared-memory channel each step reaches them through (step_channel.py)."""
