"""Structured outputs: a request's StructuredOutput parsed into a grammar (grammars.py),
compiled over the vocabulary under a deadline (compiler.py, grammar_cache.py) while the
request waits out of the scheduler (gate.py), and enforced token by token in the
sampler (matchers.py)."""
