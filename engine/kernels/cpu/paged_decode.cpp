// kvserve::paged_decode: decode attention over the paged float32 or bfloat16 KV cache,
// reading every key and value where it lies (engine/kernels/attention/cpu_paged.py's maths,
// whose torch form stays the reference and serves fp8 caches). A bf16 value is widened
// to float32 as it is loaded (its 16 bits are a float32's high half); scores, softmax
// and sums are float32 whatever the cache holds, as in the reference.
// On AVX-512 CPUs a bf16 cache's two passes take 512-bit registers instead
// (paged_decode_avx512.h); the rest is this file's, on every x86 CPU.
//
// A task is one request (when requests are few, a run of its context's blocks, or
// one of its KV heads), spread over torch's threads. It makes one pass over its keys,
// scoring every query head against each key as it is loaded; a float32 softmax per
// head; then one pass over the values, the heads' sums kept in L1. So each key and
// value is read from memory once a step, which is what a decode step's attention
// costs: the KV cache is the largest thing it reads after the weights.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "attention_shared.h"
#include "attention_isa.h"  // here, outside the namespace below: its headers include it

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using kvserve_cpu::check_queries_and_caches;
using kvserve_cpu::exp_shifted_in_place;
using kvserve_cpu::hsum;

// Eight cache values as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <typename T>  // the caches' element type: float or at::BFloat16
struct Decode {
  const float* q;        // the queries in float32
  const T* q_given;      // and as given, in the caches' dtype (AVX512-BF16's operands)
  const T *k_cache, *v_cache;
  const int32_t *tables, *lens;
  float* out;
  int64_t q_heads, kv_heads, head_dim, block_size, table_width;
  float scale;

  // Where key/value `t` of request b's KV head h starts.
  int64_t at(int64_t b, int64_t h, int64_t t) const {
    const int64_t block = tables[b * table_width + t / block_size];
    return ((block * block_size + t % block_size) * kv_heads + h) * head_dim;
  }
};

// Keys and values this many positions ahead are prefetched: the table sends each
// block of positions somewhere else in the cache, and the hardware prefetcher does
// not follow (1.3-1.5x faster at 16-28 requests of 150-550 positions, 2-core Zen 3).
constexpr int64_t kPrefetchAhead = 4;

template <typename T>
inline void prefetch(const T* p, int64_t values) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < values * int64_t(sizeof(T)); o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// The positions [begin, end) of a request that a task attends to: all of them, or
// (few requests) a run of whole blocks, merged with the others' afterwards.
struct Span {
  int64_t begin, end;
};

// A run is at least this many blocks: shorter, merging costs more than it saves.
constexpr int64_t kMinSplitBlocks = 4;

// One pass over the keys [t0, t0 + len) of request b's KV heads [h0, h1), every
// query head that shares them scored against each key as it is loaded: scores
// [heads, len], scaled.
template <typename T>
void score_keys(const Decode<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
                int64_t len, float* scores) {
  const int64_t groups = a.q_heads / a.kv_heads, dim = a.head_dim;
  const int64_t heads = (h1 - h0) * groups, span_floats = (h1 - h0) * dim;
  const float* q = a.q + (b * a.q_heads + h0 * groups) * dim;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    if (i + kPrefetchAhead < len)
      prefetch(a.k_cache + a.at(b, h0, t + kPrefetchAhead), span_floats);
    const T* k = a.k_cache + a.at(b, h0, t);
    for (int64_t head = 0; head < heads; ++head) {
      const T* kh = k + head / groups * dim;
      const float* qh = q + head * dim;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(kh + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), load8(kh + d + 8), s1);
      }
      if (d < dim) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(kh + d), s0);
      scores[head * len + i] = hsum(_mm256_add_ps(s0, s1)) * a.scale;
    }
  }
}

// One pass over the same span's values: each query head's probabilities [heads, len]
// times them, summed into acc [heads, D] (in L1).
template <typename T>
void sum_values(const Decode<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
                int64_t len, const float* probs, float* acc) {
  const int64_t groups = a.q_heads / a.kv_heads, dim = a.head_dim;
  const int64_t heads = (h1 - h0) * groups, span_floats = (h1 - h0) * dim;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    if (i + kPrefetchAhead < len)
      prefetch(a.v_cache + a.at(b, h0, t + kPrefetchAhead), span_floats);
    const T* v = a.v_cache + a.at(b, h0, t);
    for (int64_t head = 0; head < heads; ++head) {
      const __m256 p = _mm256_set1_ps(probs[head * len + i]);
      const T* vh = v + head / groups * dim;
      float* o = acc + head * dim;
      for (int64_t d = 0; d < dim; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, load8(vh + d),
                                                _mm256_loadu_ps(o + d)));
    }
  }
}

#if KVSERVE_AVX512_BUILT
#include "paged_decode_avx512.h"
#endif

// The passes this CPU takes over a cache of T: the AVX-512 ones where they can (bf16).
template <typename T>
void keys_pass(const Decode<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
               int64_t len, float* scores) {
#if KVSERVE_AVX512_BUILT
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (avx512_passes_take(a.head_dim)) return score_keys_avx512(a, b, h0, h1, t0, len, scores);
#endif
  score_keys(a, b, h0, h1, t0, len, scores);
}

template <typename T>
void values_pass(const Decode<T>& a, int64_t b, int64_t h0, int64_t h1, int64_t t0,
                 int64_t len, const float* probs, float* acc) {
#if KVSERVE_AVX512_BUILT
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (avx512_passes_take(a.head_dim))
      return sum_values_avx512(a, b, h0, h1, t0, len, probs, acc);
#endif
  sum_values(a, b, h0, h1, t0, len, probs, acc);
}

// One head's scores in place: their maximum, then exp(score - maximum) each; returns
// the maximum and the exponentials' sum.
template <typename T>
std::pair<float, float> softmax_numerators(const Decode<T>& a, float* s, int64_t len) {
#if KVSERVE_AVX512_BUILT
  if constexpr (std::is_same_v<T, at::BFloat16>)
    if (avx512_passes_take(a.head_dim)) return softmax_numerators_avx512(s, len);
#endif
  const float top = kvserve_cpu::max_of(s, len);
  return {top, exp_shifted_in_place(s, len, top)};
}

// Request b's KV heads [h0, h1) and the query heads that share them, over the
// positions `span`: `scratch` holds their scores (then probabilities) and the sums of
// their outputs. Into `out` [heads, D], the attention's output; or, given `part`,
// each head's unnormalised sums [heads, D], then its scores' maximum and its
// exponentials' sum [heads, 2], which `merge` combines with the other runs'.
template <typename T>
void attend(const Decode<T>& a, int64_t b, int64_t h0, int64_t h1, Span span,
            std::vector<float>& scratch, float* out, float* part) {
  const int64_t groups = a.q_heads / a.kv_heads, dim = a.head_dim;
  const int64_t heads = (h1 - h0) * groups;
  span.end = std::min<int64_t>(span.end, a.lens[b]);
  const int64_t len = span.end - span.begin, t0 = span.begin;
  float* dst = part ? part : out;
  float* stats = part ? part + heads * dim : nullptr;
  if (len <= 0) {  // nothing visible (never scheduled, or past its end): zeros, not NaNs
    std::fill(dst, dst + heads * dim, 0.0f);
    for (int64_t h = 0; stats && h < heads; ++h) {
      stats[2 * h] = -INFINITY;
      stats[2 * h + 1] = 0.0f;
    }
    return;
  }
  scratch.assign(heads * len + heads + heads * dim, 0.0f);
  float* scores = scratch.data();
  float* inv = scores + heads * len;
  float* acc = inv + heads;
  keys_pass(a, b, h0, h1, t0, len, scores);
  for (int64_t head = 0; head < heads; ++head) {  // softmax's exponentials, their sum
    const auto [top, sum] = softmax_numerators(a, scores + head * len, len);
    inv[head] = stats ? 1.0f : 1.0f / sum;
    if (stats) {
      stats[2 * head] = top;
      stats[2 * head + 1] = sum;
    }
  }
  values_pass(a, b, h0, h1, t0, len, scores, acc);
  for (int64_t head = 0; head < heads; ++head) {
    const __m256 s = _mm256_set1_ps(inv[head]);
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(dst + head * dim + d, _mm256_mul_ps(_mm256_loadu_ps(acc + head * dim + d), s));
  }
}

// One head's output from its runs' parts (`runs` of them, `step` floats apart): its
// sums [D] at `sums`, its scores' maximum and exponentials' sum at `stats`. Each run's
// sums weighted by e^(its maximum - the overall one), over its exponentials' sum
// weighted likewise: the softmax over every position, exactly (a run past the
// request's end, maximum -inf, weighs 0).
void merge(const float* sums, const float* stats, int64_t runs, int64_t step, int64_t dim,
           float* out) {
  float top = -INFINITY;
  for (int64_t r = 0; r < runs; ++r) top = std::max(top, stats[r * step]);
  std::fill(out, out + dim, 0.0f);
  if (top == -INFINITY) return;  // no position at all
  float total = 0.0f;
  for (int64_t r = 0; r < runs; ++r) {
    const float w = std::exp(stats[r * step] - top);
    total += w * stats[r * step + 1];
    for (int64_t d = 0; d < dim; ++d) out[d] += w * sums[r * step + d];
  }
  for (int64_t d = 0; d < dim; ++d) out[d] /= total;
}

// The attention of every request into `a.out`: the tasks below, spread over torch's
// threads, then the split runs merged.
template <typename T>
void decode_all(const Decode<T>& a, int64_t batch) {
  const int64_t q_heads = a.q_heads, kv_heads = a.kv_heads, dim = a.head_dim;
  // A task is a whole request, its keys and values read in block order, when there
  // are requests enough to keep every thread busy (2.3x faster than a task per KV
  // head at 16-28 requests). Fewer, and each request's context is split into runs of
  // whole blocks, a task each, as many as make the tasks a multiple of the threads
  // (one request's 3 KV heads on 2 threads had one thread wait on the other), each
  // at least kMinSplitBlocks long; the runs' parts are merged. A context too short
  // to split: a task per KV head, as before.
  const int64_t threads = at::get_num_threads();
  const int64_t longest = *std::max_element(a.lens, a.lens + batch);
  const int64_t blocks = (std::max<int64_t>(longest, 1) + a.block_size - 1) / a.block_size;
  int64_t splits = 1, per_task = kv_heads;
  if (batch < 2 * threads && threads > 1) {  // one thread: any tasks are balanced
    splits = std::min((2 * threads + batch - 1) / batch, blocks / kMinSplitBlocks);
    const int64_t even = splits * batch / threads * threads;  // tasks, whole rounds
    if (even >= batch) splits = even / batch;
    if (splits < 2) splits = 1, per_task = 1;
  }
  const int64_t tasks = batch * (kv_heads / per_task);
  const int64_t run = (blocks + splits - 1) / splits * a.block_size;  // positions a run
  const int64_t groups = q_heads / kv_heads, heads = per_task * groups;
  const int64_t step = heads * (dim + 2);  // a run's part: sums, then max and sum
  std::vector<float> parts(splits > 1 ? tasks * splits * step : 0);
  at::parallel_for(0, tasks * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t task = item / splits, split = item % splits;
      const int64_t b = task * per_task / kv_heads, h0 = task * per_task % kv_heads;
      float* part = splits > 1 ? parts.data() + item * step : nullptr;
      attend(a, b, h0, h0 + per_task, Span{split * run, (split + 1) * run}, scratch,
             a.out + (b * q_heads + h0 * groups) * dim, part);
    }
  });
  for (int64_t task = 0; splits > 1 && task < tasks; ++task) {
    const int64_t b = task * per_task / kv_heads, h0 = task * per_task % kv_heads;
    const float* first = parts.data() + task * splits * step;  // the task's first run
    for (int64_t h = 0; h < heads; ++h)
      merge(first + h * dim, first + heads * dim + 2 * h, splits, step, dim,
            a.out + (b * q_heads + h0 * groups + h) * dim);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale) {
  check_queries_and_caches("paged_decode", "[B, Hq, D]", q, k_cache, v_cache);
  const auto dtype = k_cache.scalar_type();
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  block_tables.scalar_type() == at::kInt && seq_lens.numel() == batch &&
                  seq_lens.scalar_type() == at::kInt,
              "paged_decode: int32 block_tables [B, W] and seq_lens [B]");
  // Queries and outputs are a few KiB: float32 copies of bf16 ones cost nothing
  // beside the caches, and the output is rounded once, as the reference's is.
  const at::Tensor queries = q.to(at::kFloat).contiguous(),
                   tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  at::Tensor out = at::empty({batch, q_heads, dim}, queries.options());
  const int64_t block_size = k_cache.size(1), width = tables.size(1);
  if (dtype == at::kFloat) {
    decode_all(Decode<float>{queries.data_ptr<float>(), queries.data_ptr<float>(),
                             k_cache.data_ptr<float>(),
                             v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(),
                             lens.data_ptr<int32_t>(), out.data_ptr<float>(), q_heads,
                             kv_heads, dim, block_size, width, static_cast<float>(scale)},
               batch);
    return out;
  }
  const at::Tensor given = q.contiguous();
  decode_all(Decode<at::BFloat16>{queries.data_ptr<float>(), given.data_ptr<at::BFloat16>(),
                                  k_cache.data_ptr<at::BFloat16>(),
                                  v_cache.data_ptr<at::BFloat16>(),
                                  tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                                  out.data_ptr<float>(), q_heads, kv_heads, dim,
                                  block_size, width, static_cast<float>(scale)},
             batch);
  return out.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_decode", paged_decode); }
