"""Engine-side benchmarks: the engine in this process, no HTTP.

`kvserve bench offline` (throughput of N requests submitted at once) and `kvserve bench
decode` (batch-1 decode speed and bandwidth utilisation, prefill speed and MFU, the
prefill/decode split of one long request). `kvserve bench serve|plot` load-test a
server over HTTP instead and live in bench/client/, which imports nothing of the engine's.
Every module here imports torch only when a benchmark runs."""
