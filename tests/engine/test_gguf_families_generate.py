"""The GGUF families' kept blocks through the engine (tests/support/gguf_families.py
makes the files): greedy tokens equal to the expansion's, eagerly for every family
and compiled for one whose experts are kept in 4-bit and byte codes (a file of its
own so that the suite's workers share the families' load)."""
from __future__ import annotations

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from tests.support.gguf_families import GREEDY, PROMPTS
from tests.support.gguf_families import family  # noqa: F401  (a fixture)


# The family whose kept layers also run compiled here: the experts' group-quantized
# one-token path (4-bit codes two to a byte, and byte codes). The rest's layers are
# the same classes (or Llama's, compiled in test_gguf_loading.py): a compile is ~25 s.
COMPILED = ("qwen3moe",)


def test_kept_blocks_generate_as_their_expansion(family):
    """Chunked prefill, a prefix hit (the second prompt shares the first's start),
    eager (and compiled): the same greedy tokens as the expansion."""
    arch, _, _, mixed = family
    runs = {}
    modes = [("kept", "auto", "off"), ("expanded", "none", "off")]
    if arch in COMPILED:
        modes.append(("compiled", "auto", "wait"))
    for name, q, compile_mode in modes:
        engine = Engine(EngineConfig(model=str(mixed), load_format="gguf", quantization=q,
                                     dtype="float32", num_kv_blocks=64, compile=compile_mode,
                                     max_num_batched_tokens=16))
        runs[name] = engine.generate(PROMPTS[:1], GREEDY) + engine.generate(PROMPTS[1:], GREEDY)
    assert all(tokens == runs["expanded"] for tokens in runs.values()), runs
