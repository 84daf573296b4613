"""Bytes a model's weights take, per --quantization: one arithmetic for
the engine's memory check and for `kvserve estimate` (which runs without torch).

`shape` is anything with the Hugging Face sizes under our names (engine's ModelConfig,
the bench client's ModelShape): hidden_size, intermediate_size, num_layers,
num_heads, num_kv_heads, head_dim, vocab_size, tie_word_embeddings (and qk_norm where
QK-norm applies). Quantization
covers the decoder layers' projections; embeddings, the LM head and the norms stay
in the model dtype (engine/weights/quantization/)."""
from __future__ import annotations

QUANTIZATIONS = ("none", "int8", "int4", "fp8")
SCALE_BYTES = 2  # int4's scale and minimum per group are float16, as in GGUF


def projection_bytes(rows: int, cols: int, dtype_bytes: float, quantization: str,
                     group_size: int = 32, scale_bytes: int = SCALE_BYTES) -> float:
    """One [rows, cols] projection: int8 keeps a scale per row in the model dtype,
    fp8 one in float32 (_scaled_mm's), int4 a scale and minimum of `scale_bytes` each
    (float16; the experts' float32) per group of `group_size` inputs."""
    weights = rows * cols
    if quantization == "none":
        return weights * dtype_bytes
    if quantization == "int8":
        return weights + rows * dtype_bytes
    if quantization == "fp8":
        return weights + rows * 4
    if quantization == "int4":
        return weights / 2 + 2 * scale_bytes * weights / group_size
    raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")


def weight_bytes(shape, dtype_bytes: float, quantization: str = "none",
                 group_size: int = 32) -> float:
    """A mixture-of-experts shape (a `moe` with num_experts, intermediate_size,
    shared_expert_intermediate_size and is_sparse(layer)) counts every expert; a
    latent-attention one (an `mla`) its own projections."""
    h = shape.hidden_size

    def size(projections, quantization: str = quantization,
             scale_bytes: int = SCALE_BYTES) -> float:
        return sum(projection_bytes(r, c, dtype_bytes, quantization, group_size, scale_bytes)
                   for r, c in projections)

    # Routed experts are quantized by int8 and int4 (on CPU; int4's group factors in
    # float32, as the experts kernel reads them); fp8 keeps them.
    experts = quantization if quantization in ("none", "int8", "int4") else "none"

    norms = 2 * h + (2 * shape.head_dim if getattr(shape, "qk_norm", False) else 0)
    attention = size(_attention_projections(shape)) + norms * dtype_bytes  # + QK-norm's
    moe = getattr(shape, "moe", None)
    total = 0.0
    for layer in range(shape.num_layers):
        if moe is not None and moe.is_sparse(layer):
            inter, shared = moe.intermediate_size, moe.shared_expert_intermediate_size
            routers = moe.num_experts + bool(moe.shared_expert_gate)  # rows of h each
            shared_mlp = size([(2 * shared, h), (h, shared)]) if shared else 0.0
            mlp = (moe.num_experts * size([(2 * inter, h), (h, inter)], experts, 4)
                   + shared_mlp + routers * h * dtype_bytes)
        else:
            inter = shape.intermediate_size
            mlp = size([(2 * inter, h), (h, inter)])
        total += attention + mlp
    tables = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return total + (tables + h) * dtype_bytes


def _attention_projections(shape) -> list[tuple[int, int]]:
    """(rows, cols) of a layer's attention projections."""
    h, d = shape.hidden_size, shape.head_dim
    mla = getattr(shape, "mla", None)
    if mla is None:
        q, kv = shape.num_heads * d, shape.num_kv_heads * d
        return [(q + 2 * kv, h), (h, q)]
    heads = shape.num_heads
    query = ([(mla.q_lora_rank, h), (heads * mla.qk_head_dim, mla.q_lora_rank)]
             if mla.q_lora_rank else [(heads * mla.qk_head_dim, h)])
    return query + [(mla.cache_dim, h),
                    (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
                    (h, heads * mla.v_head_dim)]
