"""Beam search (vLLM's `use_beam_search`) for /v1/completions and /v1/chat/completions,
run in the front end as vLLM v1 runs it: every step, each live beam is one engine
request of max_tokens 1 whose logprobs list its best next tokens; the prefix cache
holds the full blocks a beam shares with its parent and siblings, so a step computes
only the tokens past the beam's last full block. `n` is the beam width, and the n
best hypotheses are the choices, best first.

The search itself (BeamSearch) is transformers' (`generate(num_beams=n,
num_return_sequences=n, do_sample=False, length_penalty=..., early_stopping=...)`),
step for step, so its output can be checked against it token for token:
- each step ranks the best K = max(2, 1 + number of end tokens) * n continuations of
  all live beams by their summed logprobs (K per beam are enough: the engine returns
  that many logprobs, and at most 20, which caps n);
- a continuation that ends (an EOS or stop token, a stop string, max_tokens) becomes
  a finished hypothesis only if it ranks among the best n, scored sum of logprobs /
  generated_length ** length_penalty, the ending token counted; the best n
  non-ending continuations are the next beams;
- early_stopping (vLLM v0's field, transformers' values): False (the default of
  both): stop once n hypotheses are finished and the best beam, scored at its
  current length, cannot beat the worst of them; True: stop as soon as n are
  finished; "never": with length_penalty > 0, score the best beam at max_tokens.
Differences from vLLM (which scores by len(prompt + output), EOS excluded, never stops
early and keeps every EOS continuation): transformers' scoring above, which vLLM's
comment says it adapts. Differences from transformers: when every continuation ends
the search stops where transformers would go on with beams it scored -1e9 (which can
win nothing while a real beam lives); stop strings are found in the decoded text, as
for a sampled sequence (server/detokenizer.py), where transformers' stop_strings
match token strings: the two can part where a character is split over tokens. The
end tokens are the model's EOS (the engine's eos_token_ids, EngineInfo: the model
config's and the tokenizer's) and stop_token_ids.

What beam search reads: the model's raw logprobs (temperature, top_p, top_k, min_p
and seed do not apply to it: it samples nothing, as in vLLM v1 and transformers at
do_sample=False); max_tokens, ignore_eos, stop, stop_token_ids,
include_stop_str_in_output, skip_special_tokens, logprobs (the chosen tokens'); it
refuses with a 400 what would change logprobs it cannot see (penalties, logit_bias,
allowed_token_ids, bad_words, min_tokens, a grammar from tools or response_format).
Streamed, the whole result comes as one batch of chunks at the end, as in vLLM.

Its parts: server/beam_algorithm.py, the search (BeamSearch, its beams, hypotheses and
scores; pure); server/beam_engine.py, one prompt's search driven over the engine, step
by step; server/beam_requests.py, the request's checks (400s) and respond(), which
server/completions.py and server/chat.py call as beam_search.respond."""
from __future__ import annotations

from kvserve.server.beam_algorithm import (Beam, BeamSearch, BeamSpec, Candidates,
                                           Hypothesis, candidates_per_beam, max_beam_width)
from kvserve.server.beam_requests import beam_spec, respond

__all__ = ["Beam", "BeamSearch", "BeamSpec", "Candidates", "Hypothesis", "beam_spec",
           "candidates_per_beam", "max_beam_width", "respond"]
