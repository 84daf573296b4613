"""Where a benchmark result came from: machine, commit and the exact command. The
logic lives in engine/benchmarks/provenance.py (so an installed `kvserve bench` has
it); the scripts in bench/ keep importing it from here."""
from __future__ import annotations

from engine.benchmarks.provenance import git_commit, provenance  # noqa: F401

__all__ = ["git_commit", "provenance"]
