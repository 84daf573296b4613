"""kvbench: client-side tools that need no model and no torch.

- `kvserve bench serve`: a streaming load generator for any OpenAI-compatible server,
  with vLLM's metric definitions (TTFT, TPOT, ITL, E2EL, goodput).
- `kvserve bench plot`: latency against throughput from saved results.
- `kvserve estimate`: a roofline calculator (memory, KV capacity, speed ceilings, cost).

Only httpx (and tqdm; matplotlib for plots, imported when plotting) at run time, so it
runs on any client machine and never imports the server's layers."""
