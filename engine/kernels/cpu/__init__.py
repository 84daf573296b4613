"""kvserve's CPU kernels, for x86 CPUs with AVX2 and FMA (--cpu-kernels): the linear
layers' GEMM for float32 steps, over weights packed once at load (AVX2-only CPUs),
and the decode attention over float32 and bf16 paged caches (every such CPU).

Why: on an AVX2-only CPU torch's float32 GEMMs run at a third to a half of the
cores' FMA peak for the few rows of a decode step (oneDNN: 45-57 GFLOP/s at 16 rows
where two cores reach 188), and torch has no kernel that reads bf16 weights into
float32 sums there. packed_gemm.cpp does both: a 6 x 16 register tile over panels
that stay in cache across all the rows, and bf16 panels (where the weights' values
are exact in bf16, as a bf16 checkpoint's are) widened as they are loaded, so a
batch-1 step reads half the bytes. Quantized weights (GGUF's Q8_0 / Q4_0 / Q4_1
blocks, --quantization int8 / int4, and float weights that are such blocks'
values) keep their int8 or int4 bytes in the panels, widened in registers as they
are loaded: a quarter to a fifth of float32's bytes a step. They are built with the C++ compiler Inductor
needs anyway, once a machine (build.py), and called as ops (kvserve::packed_linear)
in eager steps and compiled graphs alike.

- packed_gemm.cpp: the GEMM and its op.
- paged_decode.cpp: the decode attention's op (engine/kernels/attention/cpu_paged.py).
- build.py: compiling and loading the library.
- packing.py: the packed weight layout, and the op's Python face.
- setup.py: --cpu-kernels, loading the kernels, and packing a loaded model's linear
  layers."""
