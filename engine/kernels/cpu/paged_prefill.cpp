// kvserve::paged_prefill: one request's prompt chunk attending to its whole context in
// the paged float32 or bfloat16 KV cache (causal, the chunk's own keys already
// stored), the maths of engine/kernels/attention/torch_backend.py's gather + SDPA, which stays
// the reference and serves fp8 caches.
//
// Why: torch's CPU flash attention runs at 35-70 GFLOP/s on two cores for the default
// model's 64-wide heads (a GEMM-shaped problem it splits into small blocks), and the
// gather before it copies the context out of the cache in every layer. Here each KV
// head's visible keys are copied once, transposed, into float32 (K^T in tiles of 16
// keys: [keys / 16][D][16], each tile's D x 16 floats contiguous, so a product's loads
// run in order) and its values widened likewise ([keys][D]); then every tile of query
// rows runs two register-tiled products over them: scores = Q K^T (6 rows x 16 keys
// of sums in registers), a float32 softmax per row, out = P V (3 rows x 32 dims). A
// tile is a few query positions x the query heads that share the KV head.
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
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using kvserve_cpu::check_queries_and_caches;
using kvserve_cpu::exp_shifted_in_place;

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

constexpr int64_t kKeyTile = 16;  // keys a score tile covers (two vectors)
constexpr int64_t kRowTile = 6;   // query rows a score tile covers
constexpr int64_t kPositions = 4;  // query positions a task covers (x the group's heads)

// The tiles' loops over rows and vectors are unrolled by hand (pragmas): left to
// itself GCC kept the sums in an array on the stack, a store per product.

// S[r][0, 16) for rows r < R of Q (rows `q_stride` apart): the dot products with the
// 16 keys of the K^T tile kt ([D][16]), D dims.
template <int R>
inline void score_tile(const float* q, int64_t q_stride, const float* kt, int64_t dim,
                       float* s, int64_t s_stride) {
  __m256 acc[R][2];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyTile);
    const __m256 k1 = _mm256_loadu_ps(kt + d * kKeyTile + 8);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * q_stride + d);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * s_stride, acc[r][0]);
    _mm256_storeu_ps(s + r * s_stride + 8, acc[r][1]);
  }
}

// O[r][d0, d0 + 8 NV) for rows r < R: the sum over keys t < n of P[r][t] v[t][...].
template <int R, int NV>
inline void value_tile(const float* p, int64_t p_stride, const float* v, int64_t dim,
                       int64_t n, int64_t d0, float* o, int64_t o_stride) {
  __m256 acc[R][NV];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = v + t * dim + d0;
    __m256 x[NV];
    #pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) x[j] = _mm256_loadu_ps(vt + 8 * j);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * p_stride + t);
      #pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_fmadd_ps(w, x[j], acc[r][j]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(o + r * o_stride + d0 + 8 * j, acc[r][j]);
}

// S[r][0, n) for rows r < R, n a multiple of 16: every tile of K^T (kt).
template <int R>
void scores(const float* q, int64_t dim, const float* kt, int64_t n, float* s,
            int64_t s_stride) {
  for (int64_t t = 0; t < n; t += kKeyTile)
    score_tile<R>(q, dim, kt + t * dim, dim, s + t, s_stride);
}

void scores_rows(const float* q, int64_t rows, int64_t dim, const float* kt, int64_t n,
                 float* s, int64_t s_stride) {
  int64_t r = 0;
  for (; r + kRowTile <= rows; r += kRowTile)
    scores<kRowTile>(q + r * dim, dim, kt, n, s + r * s_stride, s_stride);
  switch (rows - r) {
    case 5: scores<5>(q + r * dim, dim, kt, n, s + r * s_stride, s_stride); break;
    case 4: scores<4>(q + r * dim, dim, kt, n, s + r * s_stride, s_stride); break;
    case 3: scores<3>(q + r * dim, dim, kt, n, s + r * s_stride, s_stride); break;
    case 2: scores<2>(q + r * dim, dim, kt, n, s + r * s_stride, s_stride); break;
    case 1: scores<1>(q + r * dim, dim, kt, n, s + r * s_stride, s_stride); break;
    default: break;
  }
}

template <int R>
void values(const float* p, int64_t p_stride, const float* v, int64_t dim, int64_t n,
            float* o) {
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) value_tile<R, 4>(p, p_stride, v, dim, n, d, o, dim);
  for (; d < dim; d += 8) value_tile<R, 1>(p, p_stride, v, dim, n, d, o, dim);
}

void values_rows(const float* p, int64_t rows, int64_t p_stride, const float* v, int64_t dim,
                 int64_t n, float* o) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) values<3>(p + r * p_stride, p_stride, v, dim, n, o + r * dim);
  if (rows - r == 2) values<2>(p + r * p_stride, p_stride, v, dim, n, o + r * dim);
  if (rows - r == 1) values<1>(p + r * p_stride, p_stride, v, dim, n, o + r * dim);
}

#include "paged_prefill_bf16_dots.h"

// Keys [16 j, 16 j + 16) of KV head h (those below n; zeros past it) as the K^T tile
// kt ([D][16]) in float32, or (given kt_pairs instead, bf16 caches) as the pair tile
// ([D / 2][16] words), and their values as float32 rows of v ([keys][D]).
template <typename T>
void gather_tile(const T* k_cache, const T* v_cache, const int32_t* table, int64_t width,
                 int64_t block_size, int64_t kv_heads, int64_t dim, int64_t h, int64_t j,
                 int64_t n, float* kt, uint32_t* kt_pairs, float* v) {
  for (int64_t i = 0; i < kKeyTile; ++i) {
    const int64_t t = j * kKeyTile + i;
    if (t >= n) {
      for (int64_t d = 0; kt && d < dim; ++d) kt[d * kKeyTile + i] = 0.0f;
      for (int64_t p = 0; kt_pairs && p < dim / 2; ++p) kt_pairs[p * kKeyTile + i] = 0;
      continue;
    }
    // Past the table's last block, its last block again, as context_slots reads (the
    // graphs' warm-up steps run long prompts over a table of the spare block alone).
    const int64_t block = table[std::min(t / block_size, width - 1)];
    const int64_t at = ((block * block_size + t % block_size) * kv_heads + h) * dim;
    for (int64_t d = 0; d < dim; ++d) v[t * dim + d] = widen(v_cache[at + d]);
    if (kt_pairs != nullptr) {
      for (int64_t p = 0; p < dim / 2; ++p)
        std::memcpy(kt_pairs + p * kKeyTile + i, k_cache + at + 2 * p, sizeof(uint32_t));
      continue;
    }
    for (int64_t d = 0; d < dim; ++d) kt[d * kKeyTile + i] = widen(k_cache[at + d]);
  }
}

// q is the queries in float32; q_given as given, in the caches' dtype (the bf16
// dot products' operands).
template <typename T>
void prefill(const float* q, const T* q_given, const T* k_cache, const T* v_cache,
             const int32_t* table, int64_t width, int64_t q_len, int64_t ctx_len,
             int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
             float* out) {
  const int64_t groups = q_heads / kv_heads, pairs = dim / 2;
  const bool dots = std::is_same_v<T, at::BFloat16> && kvserve_cpu::bf16_dots_here();
  const int64_t n_pad = (ctx_len + kKeyTile - 1) / kKeyTile * kKeyTile;
  // Each KV head's keys and values, laid out for the tiles, 16 keys a task.
  std::vector<float> kts(dots ? 0 : kv_heads * dim * n_pad), vs(kv_heads * ctx_len * dim);
  std::vector<uint32_t> kt_pairs(dots ? kv_heads * pairs * n_pad : 0);
  const int64_t key_tiles = n_pad / kKeyTile;
  at::parallel_for(0, kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / key_tiles, j = task % key_tiles, tile = h * key_tiles + j;
      gather_tile(k_cache, v_cache, table, width, block_size, kv_heads, dim, h, j, ctx_len,
                  dots ? nullptr : kts.data() + tile * dim * kKeyTile,
                  dots ? kt_pairs.data() + tile * pairs * kKeyTile : nullptr,
                  vs.data() + h * ctx_len * dim);
    }
  });
  const int64_t first = ctx_len - q_len;  // the chunk's first position
  const int64_t tiles = (q_len + kPositions - 1) / kPositions;
  // A tile's cost grows with its position (it sees more keys), and torch's threads take
  // the tasks in contiguous ranges: tiles are ordered first, last, second, second to
  // last..., so every range holds as many cheap tiles as dear ones.
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs, s, o, inv;
    std::vector<uint32_t> q_pairs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kv_heads, order = task / kv_heads;
      const int64_t tile = order % 2 == 0 ? order / 2 : tiles - 1 - order / 2;
      const int64_t i0 = tile * kPositions;
      const int64_t positions = std::min(kPositions, q_len - i0);
      const int64_t rows = positions * groups;  // row = position-major, then group head
      const int64_t n = first + i0 + positions;  // keys the tile's last row sees
      const int64_t n_tile = (n + kKeyTile - 1) / kKeyTile * kKeyTile;
      s.resize(rows * n_tile);
      if (dots) {
        q_pairs.resize(rows * pairs);
        for (int64_t i = 0; i < positions; ++i)
          for (int64_t g = 0; g < groups; ++g)
            std::memcpy(q_pairs.data() + (i * groups + g) * pairs,
                        q_given + ((i0 + i) * q_heads + h * groups + g) * dim,
                        pairs * sizeof(uint32_t));
        scores_rows_pairs(q_pairs.data(), rows, pairs, kt_pairs.data() + h * pairs * n_pad,
                          n_tile, scale, s.data(), n_tile);
      } else {
        qs.resize(rows * dim);
        for (int64_t i = 0; i < positions; ++i)
          for (int64_t g = 0; g < groups; ++g) {
            const float* src = q + ((i0 + i) * q_heads + h * groups + g) * dim;
            float* dst = qs.data() + (i * groups + g) * dim;
            for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * scale;
          }
        scores_rows(qs.data(), rows, dim, kts.data() + h * dim * n_pad, n_tile, s.data(),
                    n_tile);
      }
      inv.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {  // softmax over the keys the row's position sees
        float* row = s.data() + r * n_tile;
        const int64_t seen = first + i0 + r / groups + 1;
        const float top = kvserve_cpu::max_of(row, seen);
        inv[r] = 1.0f / exp_shifted_in_place(row, seen, top);
        std::fill(row + seen, row + n_tile, 0.0f);  // masked: weigh nothing
      }
      o.resize(rows * dim);
      values_rows(s.data(), rows, n_tile, vs.data() + h * ctx_len * dim, dim, n, o.data());
      for (int64_t i = 0; i < positions; ++i)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = i * groups + g;
          float* dst = out + ((i0 + i) * q_heads + h * groups + g) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = o[r * dim + d] * inv[r];
        }
    }
  });
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_table,
                         int64_t ctx_len, double scale) {
  check_queries_and_caches("paged_prefill", "[L, Hq, D]", q, k_cache, v_cache);
  const auto dtype = k_cache.scalar_type();
  const int64_t q_len = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt &&
                  block_table.size(0) >= 1 && ctx_len >= q_len,
              "paged_prefill: an int32 block table [W] and a context of at least the "
              "chunk's length");
  const at::Tensor queries = q.to(at::kFloat).contiguous(), table = block_table.contiguous();
  at::Tensor out = at::empty({q_len, q_heads, dim}, queries.options());
  if (q_len == 0) return out.to(dtype);
  if (dtype == at::kFloat) {
    prefill(queries.data_ptr<float>(), queries.data_ptr<float>(), k_cache.data_ptr<float>(),
            v_cache.data_ptr<float>(), table.data_ptr<int32_t>(), table.size(0), q_len,
            ctx_len, q_heads, kv_heads, dim, block_size, static_cast<float>(scale),
            out.data_ptr<float>());
  } else {
    const at::Tensor given = q.contiguous();
    prefill(queries.data_ptr<float>(), given.data_ptr<at::BFloat16>(),
            k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
            table.data_ptr<int32_t>(), table.size(0), q_len, ctx_len, q_heads, kv_heads, dim,
            block_size, static_cast<float>(scale), out.data_ptr<float>());
  }
  return out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int ctx_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_prefill", paged_prefill); }
