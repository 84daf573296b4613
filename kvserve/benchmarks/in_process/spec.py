"""`kvserve bench spec`: batch-1 decode speed with and without speculative decoding,
on an input-grounded task (the answer copies much of the prompt: repeat, correct or
edit a given text), on code edits and on open-ended chat, through the model's chat
template.
Greedy, so every method must produce the same tokens (checked); the speedup is the
same text coming out faster. Reports tok/s per method and task, the speedup over no
speculation, the mean accepted length (tokens per verification step: 1 + accepted
drafts per draft) and the acceptance rate."""
from __future__ import annotations

import time

from kvserve.benchmarks.provenance import provenance
from kvserve.engine.config.engine_config import EngineConfig, SpeculativeConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams

PASSAGE = ("The old lighthouse stood at the edge of the cliff for more than a hundred "
           "years. Every night its keeper climbed the narrow stairs, lit the great "
           "lamp and watched the ships pass safely through the dark water below. When "
           "the storms came, the keeper stayed awake until morning, writing in a small "
           "book the names of the ships and the hours they passed.")
CODE = ("def moving_average(values, window):\n    result = []\n    for i in range(len("
        "values) - window + 1):\n        chunk = values[i:i + window]\n        result."
        "append(sum(chunk) / window)\n    return result\n")
TYPOS = PASSAGE.replace("lighthouse", "lighthose").replace("narrow", "narow") \
    .replace("safely", "safley")
TASKS = {
    # The answer copies the prompt's text with small edits.
    "input-grounded": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Rewrite this text, replacing 'keeper' with 'guardian' and changing nothing "
        f"else:\n\n{PASSAGE}",
        f"Correct the spelling mistakes in this text:\n\n{TYPOS}",
        f"Rewrite this text in the present tense:\n\n{PASSAGE}",
    ],
    # Edits of code: a model this small often rewrites or explains instead of copying.
    "code-edit": [
        f"Add a docstring to this Python function and return the whole function:\n\n{CODE}",
        f"Rename the function below to rolling_mean and return the full code:\n\n{CODE}",
    ],
    "open-ended": [
        "Write a short story about a robot who learns to paint.",
        "What are three good habits for staying healthy? Explain each briefly.",
        "Describe a walk through a forest in autumn.",
        "Why is the sky blue? Explain it to a ten-year-old.",
    ],
}


def methods(args) -> dict[str, SpeculativeConfig | None]:
    k = args.num_speculative_tokens
    out = {"none": None, "ngram": SpeculativeConfig("ngram", num_tokens=k)}
    if args.draft_layers:
        out["early-exit"] = SpeculativeConfig("early-exit", num_tokens=k,
                                              draft_layers=args.draft_layers)
    if args.speculative_model:
        out["draft"] = SpeculativeConfig("draft", num_tokens=k, model=args.speculative_model)
    return out


def run(args, base: EngineConfig, command: str) -> dict:
    results, reference = [], {}
    for name, spec in methods(args).items():
        engine = Engine(EngineConfig(**{**base.__dict__, "speculative": spec}))
        for task, messages in TASKS.items():
            row = _run_task(engine, messages, args.output_len)
            want = reference.setdefault(task, row.pop("tokens"))
            if row.pop("tokens", want) != want:
                raise AssertionError(f"{name} changed the greedy output of {task}")
            results.append({"method": name, "task": task, **row})
        del engine
    _add_speedups(results)
    return {**provenance(command=command), "benchmark": "speculative decoding, batch 1",
            "model": args.model_name, "dtype": base.dtype,
            "num_speculative_tokens": args.num_speculative_tokens,
            "output_len": args.output_len, "results": results,
            "batch_sweep": [row for b in args.batch_sizes for row in _sweep_point(args, base, b)]}


def _sweep_point(args, base: EngineConfig, batch: int) -> list[dict]:
    """`batch` input-grounded requests at once, n-gram speculation never switched
    off, against none: where the speedup falls below 1 is where
    --speculative-disable-batch-size should switch it off on this machine."""
    rows = []
    for name, spec in (("none", None), ("ngram", SpeculativeConfig(
            "ngram", num_tokens=args.num_speculative_tokens, disable_batch_size=0))):
        engine = Engine(EngineConfig(**{**base.__dict__, "speculative": spec,
                                        "max_num_seqs": batch}))
        messages = TASKS["input-grounded"]
        prompts = [_chat(engine, messages[i % len(messages)]) for i in range(batch)]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
        engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))
        t0 = time.perf_counter()
        generated = sum(len(t) for t in engine.generate(prompts, params))
        rows.append({"batch_size": batch, "method": name,
                     "tok_per_s": round(generated / (time.perf_counter() - t0), 2)})
        del engine
    rows[1]["speedup"] = round(rows[1]["tok_per_s"] / rows[0]["tok_per_s"], 3)
    return rows


def _run_task(engine: Engine, messages: list[str], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    prompts = [_chat(engine, m) for m in messages]
    engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    before = _stats(engine)
    tokens, elapsed = [], 0.0
    for prompt in prompts:  # one at a time: batch 1
        t0 = time.perf_counter()
        tokens.append(engine.generate([prompt], params)[0])
        elapsed += time.perf_counter() - t0
    drafts, draft_tokens, accepted = (a - b for a, b in zip(_stats(engine), before))
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "generated_tokens": generated, "seconds": round(elapsed, 3),
            "tok_per_s": round(generated / elapsed, 2),
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None}


def _chat(engine: Engine, message: str) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _stats(engine: Engine) -> tuple[int, int, int]:
    if engine.speculator is None:
        return 0, 0, 0
    s = engine.speculator.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def _add_speedups(results: list[dict]) -> None:
    base = {r["task"]: r["tok_per_s"] for r in results if r["method"] == "none"}
    for r in results:
        r["speedup"] = round(r["tok_per_s"] / base[r["task"]], 3)


def table(result: dict) -> str:
    lines = [f"{'method':<12}{'task':<16}{'tok/s':>8}{'speedup':>9}{'accept len':>12}"
             f"{'accept rate':>13}"]
    for r in result["results"]:
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        lines.append(f"{r['method']:<12}{r['task']:<16}{r['tok_per_s']:>8.1f}"
                     f"{r['speedup']:>8.2f}x{mal:>12}{rate:>13}")
    for r in result.get("batch_sweep", []):
        if r["method"] != "none":
            lines.append(f"batch {r['batch_size']:>3}: ngram {r['tok_per_s']:.1f} tok/s, "
                         f"{r['speedup']:.2f}x over none")
    return "\n".join(lines)
