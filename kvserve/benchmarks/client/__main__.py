"""`python -m bench.client bench serve ...` / `python -m bench.client estimate ...`: the same as
`kvserve bench|estimate`, for a client machine that only has this package's deps."""
import sys

from kvserve.benchmarks.client.cli import main

sys.exit(main(sys.argv[1:]))
