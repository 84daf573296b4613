"""Whether a loaded model runs on kvserve's CPU kernels (--cpu-kernels): its linear
layers' weights packed for the GEMM, and the paged attention of decodes and prompt
chunks (which needs no packing: the kernels loaded is enough; engine/kernels/attention/
cpu_paged.py and torch_backend.py call them)."""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections import Counter

import torch
from torch import nn

from kvserve.engine.kernels.cpu.bf16_pairs import PAIRS_FLAGS, is_pairs
from kvserve.engine.kernels.cpu.build import BuildError, ensure_built, load_kernels
from kvserve.engine.kernels.cpu.fake_ops import register_fake
from kvserve.engine.models.linear import Linear
from kvserve.engine.models.quantized.layer import QuantizedLinear
from kvserve.engine.platform.device import cpu_flags, resolve_device
from kvserve.engine.weights.quantization import model_bytes
from kvserve.modelstore.default_model import cache_root
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.cpu_kernels")

MODES = ("auto", "kvserve", "torch")
NEEDED_FLAGS = ("avx2", "fma", "f16c")
# The caches the attention kernels read (paged_decode.cpp, paged_prefill.cpp).
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
# How the log names each kind of panel (engine/kernels/cpu/packing.py).
KIND_NAMES = {torch.float32: "float32", torch.bfloat16: "bf16 (values exact in bf16)",
              torch.int8: "int8", torch.uint8: "int4"}


def packing_wanted(mode: str, device: torch.device, dtype: torch.dtype,
                   flags: set[str] | None = None) -> bool:
    """Whether the float layers are packed for kvserve's GEMM. auto: float32 on x86
    CPUs with AVX2 and FMA but no AVX-512, where they were measured
    (bench/results/cpu_kernels_avx2_*.md; torch's oneDNN GEMMs have AVX-512 kernels of
    their own elsewhere), and bf16 on CPUs with AVX512-BF16, in pair panels
    (bf16_pairs.py: 0.5-1.0x the time of oneDNN's GEMM over the weights it prepacked
    itself at 1-512 rows, bench/results/bf16_pairs_avx512_*.json, and one copy of the
    weights that every compiled graph reads, where oneDNN's layout was frozen into
    each). kvserve: wherever the kernels run for the dtype, else a start-up error."""
    if mode not in MODES:
        raise ModelLoadError(f"unknown --cpu-kernels {mode!r}; choose {', '.join(MODES)}")
    if mode == "torch":
        return False
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in NEEDED_FLAGS if f not in flags]
    if dtype == torch.bfloat16:
        missing += [f for f in PAIRS_FLAGS if f not in flags]
    if mode == "kvserve":
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ModelLoadError("--cpu-kernels kvserve runs float32 or bfloat16 on CPU "
                                 f"(--device cpu), not {dtype} on {device.type}; use "
                                 "--cpu-kernels auto or torch")
        if missing:
            raise ModelLoadError(f"--cpu-kernels kvserve needs a CPU with "
                                 f"{', '.join(missing)} for {str(dtype).replace('torch.', '')}"
                                 "; use --cpu-kernels torch")
        return True
    if device.type != "cpu" or missing:
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and "avx512f" not in flags)


def quantized_packing_wanted(mode: str, device: torch.device, dtype: torch.dtype,
                             flags: set[str] | None = None) -> bool:
    """Whether a quantized model's int8 / int4 layers (and its LM head, rounded to
    int8) are packed for the GEMM: wherever the float layers are, and in auto also
    under bf16 wherever the kernels run, AVX-512 CPUs included. There torch's own
    kernels for quantized weights lose to kvserve's: at one row its int8 kernel took
    1.6x and its int4 one 1.2x the time of kvserve's over the same bytes, and past 8
    rows it widens the whole weight to bf16 at every call (3x slower at 16 rows in
    int8, 8x at 64 in int4; a 2-core AVX512-BF16 Zen 4, the 1B shape's gate/up and
    down, bench/results/decode_1b_quantized_*.md)."""
    if packing_wanted(mode, device, dtype, flags):
        return True
    return (mode == "auto" and dtype == torch.bfloat16
            and kernels_run_here(mode, device, flags))


def quantized_panels_here(mode: str, device: torch.device, dtype: torch.dtype,
                          flags: set[str] | None = None) -> bool:
    """Whether pack_model will pack quantized layers here: wanted, and the kernels
    load. A layer a loader keeps only for the panels (a GGUF's Q8_0 head) would
    otherwise be expanded every call, under auto after a failed build."""
    if not quantized_packing_wanted(mode, device, dtype, flags):
        return False
    try:
        load_once()
    except BuildError:  # pack_model reports it (and stops start-up under kvserve)
        return False
    return True


def attention_wanted(mode: str, device: torch.device, dtype: torch.dtype,
                     flags: set[str] | None = None) -> bool:
    """auto and kvserve: the paged attention wherever the kernels run, on float32 and
    bf16 caches, AVX-512 CPUs included (where the GEMM is left to oneDNN). On a 2-core
    AVX512-BF16 Zen 4 the decode kernel was 2.3-3.7x faster than Inductor's loops over
    the same blocks in bf16 (2.1-4.9x in float32) at 1-32 requests of 200-600
    positions, the prompt kernel 1.2-2.0x faster than gather + SDPA
    (bench/results/cpu_paged_{decode,prefill}_avx512_2026-11-27.md)."""
    return dtype in ATTENTION_DTYPES and kernels_run_here(mode, device, flags)


def kernels_run_here(mode: str, device: torch.device, flags: set[str] | None = None) -> bool:
    """Whether --cpu-kernels lets them run and this device can (a CPU with AVX2, FMA
    and F16C): where the attention of some cache dtype would use them."""
    flags = cpu_flags() if flags is None else flags
    return (mode != "torch" and device.type == "cpu"
            and all(f in flags for f in NEEDED_FLAGS))


def pack_model(model: nn.Module, mode: str, device: torch.device, dtype: torch.dtype,
               flags: set[str] | None = None, int8_head: bool = False) -> int:
    """Loads the kernels if --cpu-kernels wants their GEMM or their attention here,
    and packs every float Linear (float32, or bf16 in pair panels) and every int8 /
    int4 layer of `model` if it wants the GEMM; returns how many layers it packed. Under auto a failed build leaves
    torch's GEMMs and Inductor's attention, after one warning; under kvserve it stops
    start-up. int8_head: the LM head (and a tied embedding, which reads its panels)
    rounded to GGUF's Q8_0 unless its values already lie on a grid, as llama.cpp's
    Q8_0 and Q4 files hold it: for a model whose decoder was quantized, where the
    head in bf16 / float32 would be the largest read of a decode step."""
    packing = packing_wanted(mode, device, dtype, flags)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    quantized_packing = bool(quantized) and quantized_packing_wanted(mode, device, dtype,
                                                                      flags)
    if not (packing or quantized_packing or attention_wanted(mode, device, dtype, flags)):
        return 0
    try:
        load_once()
    except BuildError as exc:
        if mode == "kvserve":
            raise ModelLoadError(f"--cpu-kernels kvserve: {exc}") from exc
        log.warning("kvserve's CPU kernels are not available (%s): torch's GEMMs and "
                    "Inductor's attention instead, slower on this CPU", exc)
        return 0
    if not packing and not quantized_packing:
        log.info("CPU kernels: the paged attention of decodes and prompts (%s caches); "
                 "the linear layers on torch's GEMMs", str(dtype).replace("torch.", ""))
        return 0
    head, table = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    linears = _float_layers_to_pack(model, packing, dtype, head if int8_head else None)
    before = model_bytes(model)
    tied = head in linears and table is not None and head.weight is getattr(table, "weight", None)
    for linear in linears:
        linear.pack(round_to_int8=int8_head and linear is head,
                    bf16_pairs=packing and dtype == torch.bfloat16)
    if tied:  # one copy of the table: the embedding reads the head's panels
        table.read_packed(head.packed)
    if int8_head and head in linears:
        log.info("LM head%s packed as %s (the decoder is quantized)",
                 " and tied embedding" if tied else "", kind_name(head.packed.panels))
    quantized = [m for m in quantized if m.pack()]
    kinds = Counter(kind_name(m.packed.panels) for m in [*linears, *quantized])
    log.info("CPU kernels: %d linear layers packed for kvserve's GEMM (%s)%s: %.1f "
             "MiB of weights, from %.1f MiB", len(linears) + len(quantized),
             ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
             "" if packing else f", {str(dtype).replace('torch.', '')} elsewhere",
             model_bytes(model) / 2**20, before / 2**20)
    return len(linears) + len(quantized)


def kind_name(panels: torch.Tensor) -> str:
    """How the log names a layer's kind of panels."""
    return "bf16 pairs" if is_pairs(panels) else KIND_NAMES[panels.dtype]


def _float_layers_to_pack(model: nn.Module, packing: bool, dtype: torch.dtype,
                          int8_head: nn.Module | None) -> list[Linear]:
    """Every Linear of the model's dtype on CPU where the GEMM takes the float layers
    (packing); else (a bf16 model's quantized layers on a CPU without AVX512-BF16) only
    the LM head, where it is to be rounded to int8 (int8_head)."""
    def on_cpu(m: nn.Module) -> bool:
        return isinstance(m, Linear) and m.weight is not None and m.weight.device.type == "cpu"

    if packing:
        return [m for m in model.modules() if on_cpu(m) and m.weight.dtype == dtype]
    return [int8_head] if int8_head is not None and on_cpu(int8_head) else []


@functools.cache
def load_once() -> None:
    """The kernels built if need be and loaded, once a process whatever the cache
    root (a second copy of the library would define the op again). Raises
    BuildError, and tries again at the next call, if they cannot be."""
    load_kernels(cache_root())
    register_fake()


def build_in_background(mode: str, device: str) -> threading.Thread | None:
    """Where the engine will want the kernels (a CPU with their flags, --cpu-kernels
    not torch): a thread building the library into the cache while the server does
    other things (converting its model, starting its engine: most of the 20-30 s
    build is then off a cold start's path). The engine's own load waits for it
    (build.py waits for a live process's build); a failure is left for that load
    to meet and report."""
    try:
        wanted = kernels_run_here(mode, resolve_device(device), cpu_flags())
    except ModelLoadError:  # no such device: the engine says so as it starts
        return None
    if not wanted:
        return None

    def build() -> None:
        try:
            # At the lowest priority (Linux's niceness is a thread's, and the compilers
            # this thread starts inherit it): the conversion beside it keeps its core,
            # and the compilers take what it leaves.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            ensure_built(cache_root())
        except BuildError as exc:
            log.debug("building the CPU kernels ahead of the engine failed: %s", exc)

    thread = threading.Thread(target=build, name="kvserve-cpu-kernels", daemon=True)
    thread.start()
    return thread
