"""A bf16 copy of a safetensors model directory, for the CPU comparison's "same BF16
weights": kvserve serves it (in float32 on a CPU without native bf16, reading its
bf16 copies at batch 1), and llama.cpp's `convert_hf_to_gguf.py --outtype bf16`
rounds the float32 original to the same values (both round to nearest even).

    python bench/peers/bf16_checkpoint.py SRC_DIR DST_DIR
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def convert(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                       for k, v in load_file(f).items()}
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        elif f.is_file() and f.suffix != ".gguf" and not f.name.startswith("."):
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
