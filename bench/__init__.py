"""The checkout's benchmark scripts (python bench/NAME.py), never installed: results
go to results/, peers' launchers live in peers/. The benchmarks `kvserve bench TOOL`
runs are installed with kvserve, in kvserve/benchmarks/."""
