"""Every benchmark, in one tree. Two parts are installed with kvserve and run by
`kvserve bench TOOL`: client/ (bench serve|plot and estimate: a load generator and
a roofline, clients of the HTTP API only, with no torch) and in_process/ (bench
offline|decode|spec: the engine in this process). The scripts beside them
(python bench/NAME.py) measure the rest; results go to results/, peers' launchers
live in peers/."""
