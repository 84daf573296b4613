"""Batch-1 decode's products as the compiled graphs run them: every linear layer of a
model's decoder (default: the default model's 30 layers of qkv / o / gate-up / down,
212 MB of bf16 weights, read from memory at each pass) at one row, in AOTInductor
packages with C++ wrappers, as graph_packages.py builds them, one process, passes
alternating:
  - Inductor's own GEMV kernels over frozen weights (what the frozen graphs ran at
    batch 1: the CPP GEMM template, compiled_model.BATCH_ONE);
  - kvserve::bf16_linear over pair panels, called by its C entry point (c_shims.py);
  - the same through AOTInductor's proxy executor (the dispatcher).
Every way's outputs are checked against the first's first. Medians of --passes.

    python bench/bf16_pairs_batch_one.py [--layers 30] [--shapes 960x576,...] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.benchmarks.provenance import provenance, simd_flags  # noqa: E402
from kvserve.engine.kernels.cpu.bf16_pairs import bf16_linear, pack_bf16_pairs  # noqa: E402
from kvserve.engine.kernels.cpu.c_shims import c_shims  # noqa: E402
from kvserve.engine.platform.device import cpu_flags  # noqa: E402
from kvserve.engine.weights.cpu_packing import load_once  # noqa: E402

DEFAULT_SHAPES = "960x576,576x576,3072x576,576x1536"  # N x K: the default model's


class Plain(nn.Module):
    """Each layer's product of its input row with a plain bf16 weight."""

    def __init__(self, shapes: list[tuple[int, int]]):
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(n, k).to(torch.bfloat16) * 0.02, requires_grad=False)
            for n, k in shapes)

    def forward(self, rows: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([nn.functional.linear(rows[w.shape[1]], w)[:, :1] for w in self.weights])


class Pairs(nn.Module):
    """The same weights in pair panels."""

    def __init__(self, plain: Plain):
        super().__init__()
        self.shapes = [tuple(w.shape) for w in plain.weights]
        for i, w in enumerate(plain.weights):
            self.register_buffer(f"panels{i}", pack_bf16_pairs(w.data))

    def forward(self, rows: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([bf16_linear(rows[k], getattr(self, f"panels{i}"), n, None)[:, :1]
                          for i, (n, k) in enumerate(self.shapes)])


def package(module: nn.Module, rows: dict, options: dict, folder: Path):
    folder.mkdir(parents=True)
    exported = torch.export.export(module, (rows,))
    path = torch._inductor.aoti_compile_and_package(
        exported, package_path=str(folder / "graph.pt2"), inductor_configs=options)
    with zipfile.ZipFile(path) as archive:
        archive.extractall(folder)
    (library,) = folder.rglob("*.so")
    return torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--passes", type=int, default=80)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load_once()
    torch.manual_seed(0)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] * args.layers
    plain = Plain(shapes).eval()
    pairs = Pairs(plain).eval()
    rows = {k: torch.randn(1, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
    work = Path(tempfile.mkdtemp(prefix="kvserve-pairs-b1-"))
    try:
        with torch.inference_mode():
            ways = {
                "Inductor GEMV, frozen": package(plain, rows, {
                    "freezing": True, "max_autotune": True,
                    "max_autotune_gemm_backends": "CPP"}, work / "gemv"),
                "pairs, C entry point": package(
                    pairs, rows, {"aot_inductor.custom_ops_to_c_shims": c_shims()},
                    work / "shim"),
                "pairs, proxy executor": package(pairs, rows, {}, work / "proxy")}
            inputs = list(rows.values())
            want = next(iter(ways.values())).run(inputs)[0].float()
            for name, runner in ways.items():
                got = runner.run(inputs)[0].float()
                err = ((got - want).norm() / want.norm()).item()
                if err > 2e-2:
                    raise SystemExit(f"{name}: {err:.4f} from the first way's outputs")
            times = {name: [] for name in ways}
            for _ in range(args.passes):
                for name, runner in ways.items():
                    t = time.perf_counter()
                    runner.run(inputs)
                    times[name].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = sum(n * k * 2 for n, k in shapes) / 1e6
    results = {name: {"ms": round(statistics.median(t) * 1e3, 3),
                      "GB/s": round(mb / 1e3 / statistics.median(t), 1)}
               for name, t in times.items()}
    for name, r in results.items():
        print(f"{name}: {r['ms']:.2f} ms a pass over {mb:.0f} MB = {r['GB/s']} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **provenance("cpu", " ".join(sys.argv)), "cpu_flags": simd_flags(cpu_flags()),
            "weights_mb": round(mb, 1), "layers": len(shapes), "results": results}, indent=1))


if __name__ == "__main__":
    main()
