"""The benchmarks `kvserve bench TOOL` runs, installed with kvserve: client/ (bench
serve|plot and estimate: a load generator and a roofline, clients of the HTTP API
only, with no torch) and in_process/ (bench offline|decode|spec: the engine in this
process); provenance.py says where a result came from (machine, commit, command),
for them and for the checkout's own scripts under bench/."""
