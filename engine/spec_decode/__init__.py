"""Speculative decoding: proposers (ngram.py: prompt lookup; drafters.py: the
target's first layers, or a draft model), the batched rejection sampler (rejection.py) with the
per-position logits adjustments of verification rows (positions.py), verification
of a step's drafts (verify.py) and the between-steps speculator (speculator.py).
Nothing is imported here: engine.sampling imports verify, which imports
engine.sampling's own modules, so an eager package import would be circular."""
