"""The engine: schedule, run, update (engine.py); the one place that builds its parts
(build.py); what it tells its driver (reports.py); the checks a request passes
before it is queued (request_checks.py); the KV cache events' publisher
(kv_events.py)."""
