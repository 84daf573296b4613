"""Speculative decoding building blocks: the n-gram (prompt lookup) proposer, the
batched rejection sampler that verifies drafts against the target's distribution,
and the per-position logits adjustments of the verification rows."""
from engine.spec_decode.ngram import NgramProposer, propose_ngram
from engine.spec_decode.positions import draft_positions, verification_adjustments
from engine.spec_decode.rejection import (GeneratorCheckpoints, pad_drafts, pad_positions,
                                          rejection_sample, target_probs,
                                          verification_probs)

__all__ = ["GeneratorCheckpoints", "NgramProposer", "draft_positions", "pad_drafts",
           "pad_positions", "propose_ngram", "rejection_sample", "target_probs",
           "verification_adjustments", "verification_probs"]
