"""OpenAI's Batch API: files uploaded with purpose "batch" (files.py, behind the key,
each file its owner's), batch jobs over their JSONL lines (jobs.py: their records,
kept on disk; runner.py: one job at a time, its lines through the app itself as
background requests; lines.py: one line's parse and dispatch), the routes
(routes.py), and `kvserve run-batch`, the same lines offline (offline.py)."""
