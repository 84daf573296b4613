"""Probe a server's /health from a process of its own and print one line per probe:
`<time.monotonic() at send> <seconds to answer>` (inf for a non-200).

bench/abuse.py runs this beside its streams and attackers. In a thread of the
benchmark's own process the probe waited on the client's GIL whenever the client
was busy encoding 5 MB attack bodies or parsing streamed tokens, and that wait was
counted as the server's latency. time.monotonic() is the system-wide monotonic
clock, so the benchmark can set these times against its own attack spans.

  python bench/health_probe.py http://127.0.0.1:8000 [--every 0.05]
"""
from __future__ import annotations

import argparse
import sys
import time

import httpx


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--every", type=float, default=0.05, help="seconds between probes")
    args = ap.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=120) as c:
        while True:
            t0 = time.monotonic()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            seconds = time.monotonic() - t0 if ok else float("inf")
            sys.stdout.write(f"{t0!r} {seconds!r}\n")
            sys.stdout.flush()
            time.sleep(args.every)


if __name__ == "__main__":
    main()
