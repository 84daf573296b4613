"""transformers as the reference: greedy continuations and next-token logits."""
from __future__ import annotations

import random

import torch


def load_reference(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    # Our ignore_eos keeps generating through EOS; make the reference do the same
    # (min_new_tokens would instead forbid EOS and change the argmax).
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0, -1].float()


def varied_prompts(vocab_size: int, count: int = 16, seed: int = 0,
                   lengths=(1, 2, 3, 5, 8, 13, 17, 31, 32, 33, 47, 64, 100, 129, 200, 300)
                   ) -> list[list[int]]:
    """Prompts of varied length (across block boundaries) from random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(lengths[i % len(lengths)])]
            for i in range(count)]


TIE = 1e-5  # of the largest logit: closer than this is a tie in float32


def assert_same_tokens(ref, prompts, got, want) -> None:
    """got == want, sequence by sequence, or parted at a tie: where the two tokens'
    logits (`ref`'s, float32, the arbiter) are closer than float32 rounding can tell
    apart, as vLLM's tests allow (compiled GEMMs sum in another order than eager's)."""
    for prompt, a, b in zip(prompts, got, want, strict=True):
        assert len(a) == len(b)
        if a == b:
            continue
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = reference_logits(ref, prompt + a[:i])
        gap = (logits[a[i]] - logits[b[i]]).abs().item()
        assert gap <= TIE * logits.abs().max().item(), (
            f"parted at token {i} of a {len(prompt)}-token prompt: {a[i]} vs {b[i]}, "
            f"logit gap {gap:.3g} is no tie")
