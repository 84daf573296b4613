"""`python -m kvbench bench serve ...` / `python -m kvbench estimate ...`: the same as
`kvserve bench|estimate`, for a client machine that only has this package's deps."""
import sys

from kvbench.cli import main

sys.exit(main(sys.argv[1:]))
