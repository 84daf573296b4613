"""Compiled grammars kept for reuse, bounded in bytes (--grammar-cache-bytes), least
recently used dropped first.

A count alone bounded nothing: a compiled JSON schema is ~1-2 MB over a 49k
vocabulary, but a 1000-way `choice` is 3 MB, 10,000 ways 34 MB, and a schema of
fifty length-bounded strings 18 MB (xgrammar's own `memory_size_bytes`, measured on
SmolLM2's vocabulary). Each entry is charged its grammar's size plus its key (the
spec's text, up to --max-grammar-spec-bytes). A grammar larger than the whole budget
is not kept: its request still gets it."""
from __future__ import annotations

from collections import OrderedDict

from kvserve.scheduler.structured_output import StructuredOutput


class GrammarCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the kept entries are charged, together
        self._entries: OrderedDict[StructuredOutput, tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, spec: StructuredOutput) -> bool:
        return spec in self._entries

    def get(self, spec: StructuredOutput):
        """The grammar kept for spec (now the most recently used), or None."""
        entry = self._entries.get(spec)
        if entry is None:
            return None
        self._entries.move_to_end(spec)
        return entry[0]

    def put(self, spec: StructuredOutput, grammar, grammar_bytes: int) -> bool:
        """Keeps grammar, dropping the least recently used until the rest fit; False
        (nothing kept, nothing dropped) when it alone is over the budget."""
        charge = grammar_bytes + len(spec.spec)
        if charge > self.max_bytes:
            return False
        old = self._entries.pop(spec, None)
        if old is not None:
            self.nbytes -= old[1]
        self._entries[spec] = (grammar, charge)
        self.nbytes += charge
        while self.nbytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.nbytes -= dropped
        return True
