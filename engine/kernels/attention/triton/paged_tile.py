"""The inner loop shared by the prefill and decode kernels: online softmax of a
tile of queries over a range of one request's keys, read from the paged cache.

An fp8 cache's values are converted to the query's dtype as they are loaded (the
products stay bf16/fp16 tensor-core dots); its scales are the callers': k_scale
folded into the score scale, v_scale applied to the finished output."""
import triton
import triton.language as tl

from kvserve.engine.kernels.attention.triton.common import LOG2E_JIT


@triton.jit
def soft_capped(s_log2, softcap):
    """cap * tanh(s / cap) of base-2 scores (s_log2 = s * log2(e)), in base 2; tanh
    from exp2, which every Triton target and the interpreter have."""
    # (Tensors on the left of constexprs: the interpreter's constexpr * tensor is
    # a numpy array that tl.exp2 refuses.)
    x = s_log2 / (softcap * LOG2E_JIT)
    t = tl.exp2(tl.abs(x) * (-2.0 * LOG2E_JIT))  # exp(-2|x|)
    tanh = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -tanh, tanh) * (softcap * LOG2E_JIT)


@triton.jit
def attend_paged(q, q_pos, kv_start, kv_end, table_ptr, k_cache_ptr, v_cache_ptr,
                 kv_head, scale_log2, stride_block, stride_slot, stride_head, window,
                 softcap, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """q: [BLOCK_M, BLOCK_D]; key n is visible to row m when n <= q_pos[m] and, with a
    window (> 0), n > q_pos[m] - window. SOFTCAP: scores capped at softcap. Returns
    (acc, l, m): the unnormalised output [BLOCK_M, BLOCK_D] in fp32, the softmax
    denominators and the running maxima, both in base 2."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # A finite start: a row that has seen no visible key yet gets exp2(-inf) = 0
    # weights instead of the NaN of (-inf) - (-inf).
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        # Each key row is looked up in the block table, so BLOCK_N need not match
        # the cache's block size.
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = (block * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
                  + kv_head * stride_head)
        # K is loaded already transposed, [BLOCK_D, BLOCK_N]: the interpreter's matmul
        # of a transposed view is about 1000x slower than of a fresh array.
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            s = soft_capped(s, softcap)
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        visible = visible & ((window == 0) | (offs_n[None, :] > q_pos[:, None] - window))
        acc, l_i, m_i = online_softmax(tl.where(visible, s, float("-inf")), v, acc, l_i, m_i,
                                       DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def online_softmax(s, v, acc, l_i, m_i, DOT_PRECISION: tl.constexpr):
    """(acc, l, m) after one tile of base-2 scores s [M, N] (-inf where hidden) over
    values v [N, D]: the running maxima raised, the old sums rescaled to them."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def with_sink(acc, l_i, m_i, sink_log2):
    """(acc, l, m) with a sink logit (base 2) joined to the softmax: its exp adds to
    the denominator, nothing to the output."""
    m_new = tl.maximum(m_i, sink_log2)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink_log2 - m_new), m_new
