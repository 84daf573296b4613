"""The engine's configuration: `EngineConfig` holds the serving knobs, speculative
decoding's in a `SpeculativeConfig` of its own; each knob is also a flag
(engine/config/settings.py). What the model itself is: engine/config/model_config.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.config.arg_types import non_negative, parse_bool, parse_size, positive_int
from kvserve.engine.config.kv_events_config import (KVEventsConfig,
                                                    parse_flag as parse_kv_events_flag)
from kvserve.engine.config.kv_transfer_config import (KVTransferConfig,
                                                      parse_flag as parse_kv_transfer_flag)
from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.engine.config.settings import setting

# -- structured outputs (--grammar-compile-timeout, --grammar-cache-bytes) ---------

# A normal JSON schema compiles in 0.1-0.25 s over a 49k vocabulary on 2 cores, and
# the slowest legitimate-looking one measured (fifty fields, strings of up to 206
# characters) in 10.7 s; a vocabulary of 150k tokens takes about 3x. 30 s leaves that
# room while bounding how long one spec can hold the compiler.
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 30.0
# ~200 compiled JSON schemas of 1.2 MB (a count bounded nothing: one 10,000-way
# choice is 34 MB).
DEFAULT_GRAMMAR_CACHE_BYTES = 256 << 20


# -- speculative decoding (--speculative-method, --num-speculative-tokens, ...) ---

METHODS = ("ngram", "early-exit", "draft")

# Above this many running requests the engine stops proposing: a batch this big
# keeps the hardware busy already, and every rejected draft costs a query row.
# bench/spec_decode.py measures where speculation stops paying on a machine.
DEFAULT_DISABLE_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    # ngram (prompt lookup) | early-exit (the target's first layers) | draft (a
    # smaller model with the same vocabulary, at `model`); the flag's "none": off
    method: str = setting(
        "ngram", "speculative decoding: ngram (prompt lookup: drafts copied from the "
        "request's own context), early-exit (the model's first --draft-layers layers "
        "draft) or draft (--speculative-model drafts); outputs are unchanged, only "
        "faster", flag="--speculative-method", flag_default="none",
        choices=["none", *METHODS])
    num_tokens: int = setting(4, "drafts verified per request per step",
                              flag="--num-speculative-tokens", parse=positive_int)
    disable_batch_size: int = setting(
        DEFAULT_DISABLE_BATCH_SIZE, "no drafts while more requests than this run: big "
        "batches already use the hardware (0: never switch off)",
        flag="--speculative-disable-batch-size", parse=non_negative(int))
    ngram_max: int = setting(4, "ngram: longest context suffix matched",
                             flag="--ngram-prompt-lookup-max", parse=positive_int)
    # one token matches too much by chance
    ngram_min: int = setting(2, "ngram: shortest context suffix matched",
                             flag="--ngram-prompt-lookup-min", parse=positive_int)
    draft_layers: int = setting(
        0, "early-exit: layers the draft runs (0: a quarter of the model's)",
        parse=non_negative(int))
    model: str | None = setting(
        None, "a smaller model with the same vocabulary that drafts (implies "
        "--speculative-method draft)", flag="--speculative-model")

    @classmethod
    def from_settings(cls, method: str, model: str | None, **rest) -> SpeculativeConfig | None:
        """From the flags: none without a method or a draft model."""
        if method == "none" and model is None:
            return None
        return cls("draft" if model is not None else method, model=model, **rest)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, "
                             f"not {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError("a draft model (--speculative-model) goes with the draft "
                             "method, and only with it")
        if self.disable_batch_size < 0 or self.draft_layers < 0:
            raise ValueError("disable_batch_size and draft_layers must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """The serving knobs of the engine; each is also a `kvserve serve` flag."""
    model: str = setting(
        help="Hugging Face model directory, a .gguf file, a hub id (org/name: fetched "
        "into the Hugging Face cache, HF_HUB_OFFLINE honoured), or preset:NAME for a "
        "shipped model shape with --load-format random (llama-3.2-1b, llama-3.1-8b, "
        "llama-tiny) (default: the embedded SmolLM2-135M-Instruct, converted once into "
        "the cache)", flag_default=None)
    revision: str | None = setting(
        None, "the hub revision (branch, tag or commit) of a hub id --model (default: main)")
    dtype: str = setting("auto", "weights and KV cache (auto: bf16 on CUDA and on CPUs with "
                         "native bf16 such as AVX512-BF16 or AMX, fp32 on other CPUs)",
                         choices=["auto", "float32", "bfloat16", "float16"])
    device: str = setting("auto", "auto|cpu|cuda")
    max_model_len: int | None = setting(
        None, "context length cap (default: the model's)", parse=int)
    block_size: int = setting(16, "tokens per KV-cache block", parse=int)
    # KV cache size: an explicit block count wins; else bytes.
    num_kv_blocks: int | None = setting(
        None, "KV cache size in blocks (overrides memory)", parse=int)
    kv_cache_memory: int | None = setting(
        None, "KV cache size (default: on CUDA what --gpu-memory-utilization leaves "
        "after weights and a profiled peak step; on CPU 1GiB)", parse=parse_size)
    gpu_memory_utilization: float = setting(
        0.9, "share of the GPU's memory kvserve may use (weights, activations, KV)",
        parse=float)
    max_num_seqs: int = setting(64, "most requests running at once", parse=int)
    max_num_batched_tokens: int = setting(512, "token budget of one step", parse=int)
    long_prefill_token_threshold: int = setting(
        0, "most tokens one request may compute in a step (0: no cap)", parse=int)
    # 256: bench/results/batch_interference_*: 64 kept a user's TTFT p90 lowest but
    # made nearly every step a mixed one (prompt beside decodes), doubling its ITL.
    background_prefill_tokens: int = setting(
        256, "most prompt tokens of background requests (batch jobs' lines) one step "
        "computes while interactive requests run or wait, and 2 s after, so their steps "
        "stay short (0: no cap; alone, background prompts take the whole budget)",
        parse=int)
    scheduling_policy: str = setting(
        "fcfs", "admission order (priority: lower `priority` first)",
        choices=["fcfs", "priority"])
    enable_prefix_caching: bool = setting(True, "share cached prompt prefixes",
                                          parse=parse_bool)
    # engine/kv_offload/: the second KV tier, what the prefix cache evicts kept and
    # loaded back instead of recomputed (LMCache's job in vLLM; see host_tier.py).
    kv_offload_bytes: int = setting(
        0, "host memory that keeps prefix blocks evicted from the KV cache, found again "
        "by the same hashes and loaded back instead of recomputed (0: off)",
        parse=parse_size)
    kv_offload_dir: str | None = setting(
        None, "a local directory where blocks past --kv-offload-bytes go (checksummed; "
        "found again after a restart of the same model)")
    kv_offload_disk_bytes: int = setting(
        16 << 30, "most bytes --kv-offload-dir may hold (least recently used go first)",
        parse=parse_size)
    # kvcache/hybrid.py: a hybrid model's (Gemma 2/3, gpt-oss) sliding-window layers
    # in layer groups that let go of what their window has passed; vLLM's flag.
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "keep every block of a hybrid model's sliding-window layers (one block "
        "table for all layers)", parse=parse_bool)
    load_format: str = setting(
        "auto", "read the checkpoint's *.safetensors, or one *.gguf file (a .gguf --model, "
        "or a directory's one *.gguf beside its config.json and tokenizer), or random "
        "weights of its shape; auto = gguf for a .gguf file or a directory with one and "
        "no safetensors, else safetensors", choices=["auto", "safetensors", "gguf", "random"])
    seed: int = setting(0, "global random seed", parse=int)
    attention_backend: str = setting(
        "auto", "attention kernels (auto: triton on CUDA, torch on CPU; flash-attn needs "
        "the flash_attn package and a --block-size multiple of 256)",
        choices=["auto", "triton", "flash-attn", "torch"])
    # Decode-only steps on CUDA replay CUDA graphs (one per batch-size bucket) and
    # the forward pass is compiled (see `compile`) unless this is set.
    enforce_eager: bool = setting(
        False, "eager PyTorch only: no compiled forward pass, no CUDA graphs",
        parse=parse_bool)
    # engine/runner/compiled_model.py. CUDA stays eager under auto until a GPU session has
    # measured the compiled path there (bench/gpu_session.sh).
    compile: str = setting(
        "auto", "compile the forward pass with torch.compile (needs a C++ compiler on "
        "CPU): background = serve eagerly while it compiles, wait = compile before "
        "serving; auto = background on CPU, off on CUDA",
        choices=["auto", "background", "wait", "off"])
    # engine/runner/graph_packages.py: where they apply (CPU, a (K, V) pair per layer,
    # no LoRA), the graphs as AOTInductor packages under $KVSERVE_CACHE/graphs, built
    # by a process of their own (engine/core/package_build_process.py).
    compile_cache: str = setting(
        "auto", "how compiled graphs survive a restart. packages = the CPU forward "
        "pass's graphs built ahead of time (AOTInductor) by a process of their own, "
        "kept on disk under $KVSERVE_CACHE/graphs and loaded in seconds at later "
        "starts (where they apply: CPU, no LoRA, no latent or sliding-window caches); "
        "off = Dynamo compiles them in the serving process at every start; auto = "
        "packages",
        choices=["auto", "packages", "off"])
    # engine/runner/inductor_cache.py: files of earlier starts removed past it.
    compile_cache_bytes: int = setting(
        8 << 30, "most bytes Inductor's cache under $KVSERVE_CACHE/inductor keeps "
        "between starts (the least recently used files go first; what a start wrote "
        "stays until the next; 8589934592 = 8GiB)", parse=parse_size)
    # engine/kernels/cpu/: weights packed at load, eager and compiled steps alike;
    # the paged attention of compiled steps (engine/kernels/attention/cpu_paged.py,
    # torch_backend.py).
    cpu_kernels: str = setting(
        "auto", "kvserve's CPU kernels, built once with the C++ compiler: kvserve = "
        "its GEMM for float32 linear layers, over weights packed at load (in bf16 where "
        "every value is exact in bf16, as a bf16 checkpoint's are: half the bytes a "
        "token), and for bfloat16 ones on CPUs with AVX512-BF16 (bf16 dot products), "
        "and its paged attention of decodes and prompts in compiled steps; torch = "
        "torch's GEMMs (oneDNN in compiled graphs) and torch's attention; auto = the "
        "GEMM for float32 on x86 CPUs with AVX2 and FMA but no AVX-512 and for bfloat16 "
        "where the CPU has AVX512-BF16, the attention (float32 and bf16 caches) on all "
        "x86 CPUs with AVX2",
        choices=["auto", "kvserve", "torch"])
    # engine/weights/quantization/: weights quantized at load (online quantization), or a
    # GGUF's quantized blocks kept as they are (engine/weights/gguf_loader.py).
    quantization: str = setting(
        "auto", "quantized weights: auto = the checkpoint's own (a GGUF's quantized "
        "blocks, K-quants included, served as they are, float weights as floats); none = "
        "every weight in --dtype; int8 = weight-only int8, per-channel scales (a "
        "mixture-of-experts model's routed experts too, on CPU); int4 = weight-only int4, "
        "a scale and minimum per --quantization-group-size inputs (routed experts too, on "
        "CPU); int4-sym = symmetric int4, GGUF Q4_0's grid (a scale alone per group: on "
        "CPU 4.5 bits a weight, not 5, a tenth fewer bytes read a token, a little more "
        "error; routed experts stay int4); -awq = with "
        "activation-aware scales searched on a calibration text at load; fp8 = e4m3 "
        "weights and per-token activations (GPUs of compute capability 8.9+). They "
        "quantize the decoder layers of a float checkpoint; embeddings and the LM head "
        "stay in --dtype",
        choices=["auto", "none", "int8", "int4", "int4-sym", "int8-awq", "int4-awq", "fp8"])
    # engine/weights/quantization/kv_fp8.py: K/V stored as one byte each, per-layer scales.
    kv_cache_dtype: str = setting(
        "auto", "KV cache values: auto = --dtype; fp8 (or fp8_e4m3) = float8 e4m3 with "
        "a K and a V scale per layer measured on a calibration text at load: half the "
        "bytes, twice the blocks in the same memory", choices=["auto", "fp8", "fp8_e4m3"])
    quantization_group_size: int = setting(
        32, "int4: inputs sharing one scale and minimum (32: GGUF Q4_1's blocks; 64; 128)",
        parse=int, choices=[32, 64, 128])
    # engine/structured/: the library whose grammars and matchers constrain outputs.
    structured_outputs_backend: str = setting(
        "xgrammar", "grammar library of structured outputs and tool calls: xgrammar, or "
        "guidance (llguidance; structural tags stay xgrammar's)",
        choices=["xgrammar", "guidance"])
    # engine/structured/compiler.py: a compile cannot be stopped, only given up on.
    grammar_compile_timeout: float = setting(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT, "seconds a structured output's grammar (or a "
        "tool call's) may compile; past it the request is refused with a 400 and the "
        "compile left to finish at the lowest CPU priority, and a grammar that waited "
        "this long without starting is a 503 (0: no limit)", parse=non_negative(float))
    grammar_cache_bytes: int = setting(
        DEFAULT_GRAMMAR_CACHE_BYTES, "most memory the compiled grammars kept for reuse "
        "may hold together (xgrammar's estimate of each), least recently used dropped "
        "first (0: keep none)", parse=parse_size)
    # Speculative decoding (None: off): drafts verified by the target in one pass.
    speculative: SpeculativeConfig | None = setting(
        None, "speculative decoding", nested=SpeculativeConfig)
    # Multi-LoRA serving (None: off): adapters chosen per request (engine/lora/).
    lora: LoRAConfig | None = setting(None, "LoRA adapters", nested=LoRAConfig)
    # engine/kv_events/: the prefix cache's changes for prefix-aware routers.
    kv_events_config: KVEventsConfig | None = setting(
        None, "KV cache events as vLLM publishes them, a JSON object: "
        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://127.0.0.1:5557\", \"topic\": \"kv\"}' (also replay_endpoint, "
        "buffer_steps, hwm, max_queue_size). They carry the token ids of every tenant's "
        "prompts: the endpoint binds 127.0.0.1 unless given (\"tcp://*:5557\" for a "
        "router on another host: let only the router reach it), and "
        "\"include_token_ids\": false sends block hashes only (vllm-router's kv_aware "
        "needs the ids)", parse=parse_kv_events_flag)
    # engine/kv_transfer/: prefill/decode disaggregation, a prompt's KV blocks moved
    # from a prefill instance to a decode one (the router passes kv_transfer_params).
    kv_transfer_config: KVTransferConfig | None = setting(
        None, "prefill/decode disaggregation as vLLM configures it, a JSON object: "
        "'{\"kv_connector\": \"MooncakeConnector\", \"kv_role\": \"kv_producer\"}' "
        "(kv_consumer on the decode instance, kv_both either; also kv_ip, default "
        "127.0.0.1, the address the other instance reaches this one's KV at, kv_port, "
        "engine_id, kv_connector_extra_config: hold_timeout_s, fetch_timeout_s, "
        "protocol tcp|rdma). Run behind vllm-router --vllm-pd-disaggregation",
        parse=parse_kv_transfer_flag)
    # engine/parallel/: the model split over ranks, one process each (rank 0 is the
    # engine's own), its layers' partial sums all-reduced.
    tensor_parallel_size: int = setting(
        1, "ranks the model is split over (tensor parallelism; one GPU each, or one "
        "process each on CPU)", parse=positive_int)
    # engine/ranks/pipeline.py: the layers split into consecutive stages, one process
    # each (the engine's own runs the last and samples), P steps in flight.
    pipeline_parallel_size: int = setting(
        1, "stages the model's layers are split over (pipeline parallelism; one "
        "process each, the engine's own the last), as many steps in flight",
        parse=positive_int)
    # engine/ranks/: those ranks over several hosts, joined by torch.distributed's TCP
    # rendezvous on node 0; every other node runs `kvserve serve --headless`.
    nnodes: int = setting(
        1, "hosts the ranks are spread over, tensor-parallel-size x "
        "pipeline-parallel-size / nnodes on each", parse=positive_int)
    node_rank: int = setting(
        0, "this host's place among them: 0 serves HTTP, the others run --headless",
        parse=int)
    master_addr: str | None = setting(
        None, "node 0's address, where the other nodes join its rendezvous (default: "
        "$MASTER_ADDR, as torchrun sets it, else 127.0.0.1)")
    master_port: int | None = setting(
        None, "the rendezvous's port on node 0 (default: $MASTER_PORT; with one node "
        "a free port; several nodes need one)", parse=int)
    # Plan and launch step N+1 while step N runs on the device, its sampled tokens
    # fed to N+1 there: the scheduler, batch preparation and output handling leave
    # the critical path. Not with speculative decoding (drafts need the tokens).
    async_scheduling: bool = setting(
        False, "plan and launch each step while the previous one runs on the device "
        "(hides the scheduler's time; not with speculative decoding)", parse=parse_bool)

    def context_cap(self, model_config) -> int:
        """The context length every rank is built for: --max-model-len, at most the
        model's (node 0 caps it further by its KV cache's size)."""
        return min(self.max_model_len or model_config.max_model_len,
                   model_config.max_model_len)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be at least 1")
        if (self.tensor_parallel_size * self.pipeline_parallel_size) % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} does not divide the ranks "
                             f"(--tensor-parallel-size {self.tensor_parallel_size} x "
                             f"--pipeline-parallel-size {self.pipeline_parallel_size})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not one of --nnodes "
                             f"{self.nnodes}'s (0 to {self.nnodes - 1})")
        if self.async_scheduling and self.speculative is not None:
            raise ValueError("async scheduling does not work with speculative decoding")
