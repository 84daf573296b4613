"""Real llama.cpp K-quant files through kvserve (issue 52): a random-weight Llama (or
Qwen3-MoE, Qwen2-MoE, Gemma 3, gpt-oss: --arch) of widths that fill the K-quants' 256-input blocks, with the default model's tokenizer,
converted by llama.cpp's own convert_hf_to_gguf.py and quantized by its
llama-quantize into each type; each file loaded by kvserve as it is (--model
FILE.gguf) with its blocks kept (--quantization auto) and expanded (none):
the file's tensor types, the layers they became, resident bytes against the
file's tensor bytes, and whether greedy tokens agree (they must: the kept layers
hold exactly gguf's de-quantization).

    python bench/gguf_kquants.py --llama-cpp DIR [--types Q4_K_M Q5_K_M ...] [--arch qwen3moe]

DIR: llama.cpp's source tree with build/bin/llama-quantize built (bench/peers/).
convert_hf_to_gguf.py needs `sentencepiece` importable (pip install --target X
sentencepiece; PYTHONPATH=X)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TYPES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "Q6_K", "IQ4_XS", "IQ4_NL")
PROMPT = "The capital of France is Paris. The capital of Italy is"


# Each architecture's extra config fields: the mixtures of experts' experts are 256
# wide too (their down projections' inputs fill a K-quant block).
ARCHS = {"llama": ("LlamaConfig", {}),
         "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=64, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=256, norm_topk_prob=True)),
         "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=256,
                                             shared_expert_intermediate_size=512)),
         # six layers: llama.cpp takes Gemma 3's five sliding layers to a full one as given
         "gemma3": ("Gemma3TextConfig", dict(head_dim=64, query_pre_attn_scalar=64,
                                             sliding_window=16, num_hidden_layers=6,
                                             tie_word_embeddings=True)),
         "gpt-oss": ("GptOssConfig", dict(head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                                          intermediate_size=256, sliding_window=16))}


def make_checkpoint(out: Path, arch: str = "llama") -> None:
    import torch
    import transformers

    from kvserve.modelstore.default_model import ensure_default_model

    default = ensure_default_model()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default / name, out / name)
    torch.manual_seed(0)
    config_class, extra = ARCHS[arch]
    fields = dict(vocab_size=49152, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    cfg = getattr(transformers, config_class)(**{**fields, **extra})
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)


def convert(llama_cpp: Path, hf_dir: Path, work: Path, types: list[str]) -> dict[str, Path]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(llama_cpp / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    f32 = work / "f32.gguf"
    subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir),
                    "--outfile", str(f32), "--outtype", "f32"], env=env, check=True,
                   capture_output=True)
    binary = llama_cpp / "build" / "bin" / "llama-quantize"
    lib_env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    files = {}
    for kind in types:
        files[kind] = work / f"{kind}.gguf"
        subprocess.run([str(binary), str(f32), str(files[kind]), kind], env=lib_env,
                       check=True, capture_output=True)
    return files


def f32_against_transformers(hf_dir: Path, f32: Path) -> dict:
    """The converter's F32 file served alone (config and tokenizer from its metadata)
    against transformers on the checkpoint it was converted from: greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(f32), dtype="float32", num_kv_blocks=64))
    prompt = engine.tokenizer.encode(PROMPT)
    ours = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0,
                                                    ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    return {"architecture": engine.model_config.architecture,
            "greedy_equal_to_transformers": list(ours) == theirs}


def measure(kind: str, path: Path) -> dict:
    import gguf

    from kvserve.engine.config.engine_config import EngineConfig
    from kvserve.engine.core.engine import Engine
    from kvserve.engine.platform.gguf_checkpoint import GGUFCheckpoint
    from kvserve.engine.weights.quantization import resident_bytes
    from kvserve.scheduler.sampling_params import SamplingParams

    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    row = {"type": kind, "file_types": dict(types),
           "file_tensor_bytes": GGUFCheckpoint(path).tensor_bytes()}
    tokens = {}
    for quantization in ("auto", "none"):
        engine = Engine(EngineConfig(model=str(path), quantization=quantization,
                                     dtype="float32", num_kv_blocks=64))
        model = engine.runner.model
        row[f"resident_bytes_{quantization}"] = resident_bytes(model)
        if quantization == "auto":
            row["layers"] = dict(Counter(type(m).__name__ for m in model.modules()
                                         if "Linear" in type(m).__name__
                                         or "Quantized" in type(m).__name__))
            experts_file = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors
                               if t.name.endswith("_exps.weight"))
            if experts_file:  # the routed experts alone (gguf_experts.py)
                held = sum(t.numel() * t.element_size() for m in model.modules()
                           if type(m).__name__ == "FusedExperts"
                           for t in [*m.parameters(), *m.buffers()])
                row["experts_resident_over_file"] = round(held / experts_file, 3)
        prompt = engine.tokenizer.encode(PROMPT)
        tokens[quantization] = engine.generate(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    row["resident_over_file"] = round(row["resident_bytes_auto"] / row["file_tensor_bytes"], 3)
    row["expanded_fp32_over_file"] = round(row["resident_bytes_none"] / row["file_tensor_bytes"], 3)
    row["greedy_equal_to_expansion"] = tokens["auto"] == tokens["none"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS),
                        help="the random checkpoint's architecture")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from kvserve.benchmarks.provenance import simd_flags
    from kvserve.engine.platform.device import cpu_flags

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_checkpoint(work / "hf", args.arch)
        files = convert(args.llama_cpp, work / "hf", work, args.types)
        f32 = f32_against_transformers(work / "hf", work / "f32.gguf")
        rows = [measure(kind, path) for kind, path in files.items()]
    result = {"arch": args.arch, "cpu_flags": simd_flags(cpu_flags()), "f32_file": f32,
              "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
