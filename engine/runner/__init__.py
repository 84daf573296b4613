"""One step on the device: the runner (model_runner.py) builds the flat batch
(step_batch.py, block_table_rows.py), and forward_paths.py picks its forward pass:
eager, Inductor-compiled (compiled_model.py, direct_graph.py; compile_process.py for
what compiling means to the process) or CUDA graphs (cuda_graphs.py); pooling.py
sums embeddings; memory_budget.py sizes the KV cache from a profiled step."""
