"""Speculative decoding's proposing side: the n-gram proposer (ngram.py: prompt
lookup), the drafters (drafters.py: the target's first layers, or a draft model)
and the between-steps speculator (speculator.py) that sets each request's drafts.
Verifying them is sampling's business (engine/sampling/verify.py, with the
rejection sampler and the per-position logits adjustments beside it); the settings
are a SpeculativeConfig in engine/config/engine_config.py."""
