"""Structured outputs: a request's StructuredOutput compiled into an xgrammar grammar
(grammars.py) and enforced token by token in the sampler (matchers.py)."""
