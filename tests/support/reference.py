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
