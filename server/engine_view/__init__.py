"""The live engine view behind the engine page (GET /): one Server-Sent Events
stream, GET /v1/engine/stream, of engine snapshots (queues, each request's phase and
progress, the KV cache's block map) a few times a second while someone watches, and
of a history of serving figures (TTFT, ITL, tokens per step, prefix hits,
speculative acceptance) sampled every second from the counters /metrics
already keeps."""
