// packed_gemm.cpp's micro-kernels for CPUs with AVX512-VNNI and VBMI: integer
// products of int4 and int8 panels with x quantized to int8 (vpdpbusd). Included by
// packed_gemm.cpp inside its namespace, after the helpers they share (clear,
// fold_group, store_tile); each is compiled for those instructions alone and called
// only where the CPU has them (vnni_here). Their loops over groups and blocks repeat
// micro_dot's: a step compiled for VNNI cannot be inlined into a loop that is not,
// and a call per step of four K rows would cost more than the step.
#pragma once

// What micro_dot_vnni is compiled for; called only where the CPU has it (vnni_here),
// and not where $KVSERVE_NO_VNNI is set (the tests' way to reach micro_dot there).
#define KVSERVE_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi"

bool vnni_here() {
  static const bool here = KVSERVE_AVX512_BUILT && std::getenv("KVSERVE_NO_VNNI") == nullptr &&
                           __builtin_cpu_supports("avx512vnni") &&
                           __builtin_cpu_supports("avx512vbmi") &&
                           __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bw");
  return here;
}

// One vpdpbusd with x's four inputs at x broadcast from memory (EVEX {1to16}): no
// broadcast instruction of its own, which left the many-row kernel's steps bound by
// the instructions issued rather than by the dot products (one core of the 2-core
// Zen 4: a loop of 12 dot products, 6 broadcasts and a weight's unpacking ran at 0.77x
// the dot products' own rate, 0.89x with the broadcasts embedded). GCC does not embed
// a broadcast that two instructions share, hence the asm.
__attribute__((target(KVSERVE_VNNI_TARGET), always_inline)) inline __m512i dot_x4(
    __m512i acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// A tile of sums kept in registers, one a row and panel, stored as store_tile stores.
template <int MR, int NP>
__attribute__((target(KVSERVE_VNNI_TARGET), always_inline)) inline void store_totals(
    const __m512 (&total)[MR][NP], float* __restrict c, int64_t ldc,
    const float* __restrict col_scale, const float* __restrict bias, int64_t n_left) {
  alignas(64) float acc[MR][NP][kPanel];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) _mm512_store_ps(acc[m][p], total[m][p]);
  store_tile<MR, NP>(acc, c, ldc, col_scale, bias, n_left);
}

// micro_dot with AVX512-VNNI (vpdpbusd: four unsigned 4-bit weights times four signed
// 8-bit inputs summed into each 32-bit lane, no 16-bit intermediate) on 512-bit
// registers, one a row and panel: lane j is column j. A 64-byte load holds K rows
// k..k+7 as 8 bytes each (byte j: column j's nibble low, column j + 8's high); one
// byte permutation (vpermb) a half puts rows k..k+3 (or k+4..k+7) of column j side by
// side in lane j, the same byte for j and j + 8, and one mask keeps the low nibble in
// lanes 0-7 and the high one, unshifted (16 times its value), in lanes 8-15. Those
// lanes' sums are 16 times the true ones, exact in int32 and float32 (at most
// 32 * 240 * 127 a block), and their group scale is taken a sixteenth: scaling by a
// power of two is exact, so the sums are the 256-bit kernel's bit for bit (that
// kernel needed a shift and two masks a 4-row step, and its twice as many registers
// a row left 6 rows one panel). Against it, one thread of the 2-core Zen 4 with the
// weights in L2: 1.5-1.9x at 4-6 rows, 1.2-1.5x at 2-3 (group 32 and 128). No lambdas
// here: they would not inherit the function's target. (Its block and group loops come
// first, then the kernel.)

// One block of kDotBlock K rows of micro_dot_vnni: each row's integer sums against NP
// panels, four steps of eight K rows (a 64-byte line of each panel a step, prefetched
// 4 KiB ahead).
template <int MR, int NP>
__attribute__((target(KVSERVE_VNNI_TARGET), always_inline)) inline void block_dots_vnni(
    __m512i (&sum)[MR][NP], const uint8_t* __restrict block, int64_t panel_stride,
    const int8_t* xb, int64_t lda, __m512i rows_lo, __m512i rows_hi, __m512i nibbles) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) sum[m][p] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int s = 0; s < kDotBlock / 8; ++s) {
    __m512i w0[NP], w1[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const uint8_t* rows = block + p * panel_stride + 64 * s;
      _mm_prefetch(reinterpret_cast<const char*>(rows + U4Panel::kPrefetchRows *
                                                            U4Panel::kRowElems),
                   _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(rows);
      w0[p] = _mm512_and_si512(_mm512_permutexvar_epi8(rows_lo, v), nibbles);
      w1[p] = _mm512_and_si512(_mm512_permutexvar_epi8(rows_hi, v), nibbles);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        sum[m][p] = dot_x4(sum[m][p], w0[p], xb + m * lda + 8 * s);
        sum[m][p] = dot_x4(sum[m][p], w1[p], xb + m * lda + 8 * s + 4);
      }
  }
}

// micro_dot_vnni's loop over the groups: each block's integer sums scaled by x's step
// (summed over the group's blocks), then the group's scale and minimums' share added
// into total. kOneBlock: groups of one block, a loop over blocks with nothing carried
// from one to the next.
template <int MR, int NP, bool kOneBlock>
__attribute__((target(KVSERVE_VNNI_TARGET), always_inline)) inline void vnni_groups(
    __m512 (&total)[MR][NP], int64_t lda, const uint8_t* __restrict b, int64_t panel_stride,
    const Groups& g, int64_t groups, int64_t blocks, int64_t blocks_per_group,
    __m512i rows_lo, __m512i rows_hi, __m512i nibbles, __m512 sixteenth) {
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 part[MR][NP];
    __m512i sum[MR][NP];
    const int64_t first = gi * blocks_per_group;
    const int64_t last = kOneBlock ? gi : first + blocks_per_group - 1;
    for (int64_t bi = first; bi <= last; ++bi) {
      block_dots_vnni<MR, NP>(sum, b + bi * kDotBlock * U4Panel::kRowElems, panel_stride,
                              g.x_q + bi * kDotBlock, lda, rows_lo, rows_hi, nibbles);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 step = _mm512_set1_ps(g.x_step[m * blocks + bi]);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const __m512 dots = _mm512_cvtepi32_ps(sum[m][p]);
          part[m][p] = kOneBlock || bi == first ? _mm512_mul_ps(dots, step)
                                                : _mm512_fmadd_ps(dots, step, part[m][p]);
        }
      }
    }
    // fold_group's arithmetic on 16 columns a register (the same sums)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const int64_t at = (p * groups + gi) * kPanel;
      const __m512 group_scale =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.scales + at)));
      const __m512 scale = _mm512_mul_ps(group_scale, sixteenth);
      // int4_min's minimums: stored, or -8 times the scale for symmetric panels
      const __m512 mins =
          g.mins != nullptr
              ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.mins + at)))
              : _mm512_mul_ps(group_scale, _mm512_set1_ps(-8.0f));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        total[m][p] = _mm512_fmadd_ps(part[m][p], scale, total[m][p]);
        total[m][p] = _mm512_fmadd_ps(_mm512_set1_ps(g.x_sums[m * groups + gi]), mins,
                                      total[m][p]);
      }
    }
  }
}

// The tile's sums kept in registers (total) across the groups, and a group of one
// block (32: --quantization int4's default, GGUF's Q4_0 / Q4_1) folded as its block
// ends, with no partial sums carried past it: at 64-256 rows of a 1B model's gate/up
// (16384 x 2048) on the 2-core Zen 5, 1.25x the speed of folding into a tile in memory
// after a loop over each group's blocks (455 -> 572 GMAC/s at 256 rows, 449 -> 559 at
// 64; group 128 584 -> 596). The same operations in the same order, so the same sums
// bit for bit (the one-row kernel's too).
template <int MR, int NP>
__attribute__((target(KVSERVE_VNNI_TARGET))) void micro_dot_vnni(
    int64_t lda, const uint8_t* __restrict b, int64_t k_len, const Groups& g,
    float* __restrict c, int64_t ldc, const float* __restrict col_scale,
    const float* __restrict bias, int64_t n_left) {
  const int64_t panel_stride = k_len * U4Panel::kRowElems;
  const int64_t groups = k_len / g.len, blocks = k_len / kDotBlock;
  alignas(64) uint8_t order[2][64];
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 16; ++j)
      for (int r = 0; r < 4; ++r)
        order[half][4 * j + r] = static_cast<uint8_t>(32 * half + 8 * r + j % 8);
  const __m512i rows_lo = _mm512_load_si512(order[0]), rows_hi = _mm512_load_si512(order[1]);
  const __m512i nibbles =
      _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(char(0xF0)), 1);
  const __m512 sixteenth = _mm512_castpd_ps(_mm512_insertf64x4(
      _mm512_castps_pd(_mm512_set1_ps(1.0f)), _mm256_castps_pd(_mm256_set1_ps(0.0625f)), 1));
  __m512 total[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) total[m][p] = _mm512_setzero_ps();
  const int64_t blocks_per_group = g.len / kDotBlock;
  if (blocks_per_group == 1)
    vnni_groups<MR, NP, true>(total, lda, b, panel_stride, g, groups, blocks, 1, rows_lo,
                              rows_hi, nibbles, sixteenth);
  else
    vnni_groups<MR, NP, false>(total, lda, b, panel_stride, g, groups, blocks,
                               blocks_per_group, rows_lo, rows_hi, nibbles, sixteenth);
  store_totals<MR, NP>(total, c, ldc, col_scale, bias, n_left);
}

// micro_dot_vnni for one row of x (a batch-1 decode, bound by the weight's bytes) on
// 512-bit registers: a 64-byte load is K rows k..k+7 of the panel, and one vpermb
// puts byte j of rows k..k+3 in 32-bit lane 2j and of rows k+4..k+7 in lane 2j + 1,
// which x's eight inputs broadcast as one 64-bit word meet; adjacent lanes are added
// at the end of each block. Half the instructions a byte of the 256-bit many-row
// kernel of the time, and the stream prefetched into L2 (T1), not L1: on the 2-core
// Zen 4 a 1B model's int4 layers of one step (608 MB) took 0.88x the time (median of
// 40 alternating steps, 22.3 against 25.4 ms; the prefetch alone 0.95x), the same
// sums bit for bit. In a panel's last kPrefetchBytes the prefetch skips to the panel
// the next call reads in its place (NP on), not the next one of this call, read
// already: a cold start for all but one of each call's streams otherwise. Ten of a
// 1B model's gate/up layers, one row, 2-core Zen 5 (throwaway, five alternations, host
// bimodal): symmetric int4 3.75-4.13 against 4.53-4.55 ms in the host's fast phases,
// about the same in its slow ones. (The same skip for int8 panels was slower there,
// 38.7-52.0 against 41.9-59.9 GB/s in four alternations, so they keep theirs.)
template <int NP>
__attribute__((target(KVSERVE_VNNI_TARGET))) void micro_dot_vnni_row(
    const uint8_t* __restrict b, int64_t k_len, const Groups& g, float* __restrict c,
    int64_t ldc, const float* __restrict col_scale, const float* __restrict bias,
    int64_t n_left) {
  constexpr int64_t kPrefetchBytes = 4096;
  const int64_t panel_stride = k_len * U4Panel::kRowElems;
  const int64_t groups = k_len / g.len;
  alignas(64) uint8_t order[64];
  for (int col = 0; col < 8; ++col)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r)
        order[4 * (2 * col + h) + r] = static_cast<uint8_t>(8 * (4 * h + r) + col);
  const __m512i quads = _mm512_load_si512(order);
  const __m512i nibble = _mm512_set1_epi8(15);
  alignas(32) float acc[1][NP][kPanel] = {};
  const int64_t blocks_per_group = g.len / kDotBlock;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m256 part[1][NP][2];
    clear(part, _mm256_setzero_ps());
    for (int64_t bi = gi * blocks_per_group; bi < (gi + 1) * blocks_per_group; ++bi) {
      __m512i sum[NP][2];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) sum[p][0] = sum[p][1] = _mm512_setzero_si512();
      const int64_t k0 = bi * kDotBlock;
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + kDotBlock; k += 8) {
        const int64_t skip =  // to the next call's panel, near this one's end (above)
            k * U4Panel::kRowElems >= panel_stride - kPrefetchBytes ? (NP - 1) * panel_stride : 0;
        int64_t eight;
        std::memcpy(&eight, g.x_q + k, sizeof(eight));
        const __m512i x = _mm512_set1_epi64(eight);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const uint8_t* rows = b + p * panel_stride + k * U4Panel::kRowElems;
          _mm_prefetch(reinterpret_cast<const char*>(rows + kPrefetchBytes + skip), _MM_HINT_T1);
          const __m512i v = _mm512_permutexvar_epi8(quads, _mm512_loadu_si512(rows));
          sum[p][0] = _mm512_dpbusd_epi32(sum[p][0], _mm512_and_si512(v, nibble), x);
          sum[p][1] = _mm512_dpbusd_epi32(
              sum[p][1], _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), x);
        }
      }
      const __m256 step = _mm256_set1_ps(g.x_step[bi]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          // lane 2j + lane 2j + 1 into the low half of each 64-bit word, kept (vpmovqd)
          const __m512i s = _mm512_add_epi32(sum[p][h], _mm512_srli_epi64(sum[p][h], 32));
          part[0][p][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_cvtepi64_epi32(s)), step,
                                          part[0][p][h]);
        }
    }
    fold_group<1, NP, U4Panel>(part, acc, g, gi, groups);
  }
  store_tile<1, NP>(acc, c, ldc, col_scale, bias, n_left);
}

// micro_dot_i8_vnni's loop over the groups, its sums kept in registers (total);
// kOneBlock: groups of one block (GGUF's Q8_0), nothing carried from block to block (as
// vnni_groups; Q8_0 panels at 256 rows of the shape above: 453 -> 630 GMAC/s).
template <int MR, int NP, typename Base, bool kOneBlock>
__attribute__((target(KVSERVE_VNNI_TARGET), always_inline)) inline void i8_vnni_groups(
    __m512 (&total)[MR][NP], int64_t lda, const int8_t* __restrict b, int64_t panel_stride,
    const Groups& g, int64_t groups, int64_t blocks, int64_t blocks_per_group,
    __m512i quads, __m512i flip) {
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 part[MR][NP];
    const int64_t first_block = gi * blocks_per_group;
    const int64_t last_block = kOneBlock ? gi : first_block + blocks_per_group - 1;
    for (int64_t bi = first_block; bi <= last_block; ++bi) {
      __m512i sum[MR][NP];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) sum[m][p] = _mm512_setzero_si512();
      const int8_t* block = b + bi * kDotBlock * I8Panel::kRowElems;
      const int8_t* xb = g.x_q + bi * kDotBlock;
      // Eight steps of four K rows, a 64-byte line of each panel a step.
#pragma GCC unroll 8
      for (int s = 0; s < kDotBlock / 4; ++s) {
        __m512i w[NP];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const int8_t* rows = block + p * panel_stride + 64 * s;
          // The stream goes into L2 (T1), as micro_dot_vnni_row's does: into L1 (T0) it
          // left the default model's int8 batch-1 step 1.39x slower on the 2-core Zen 4
          // (in-process and compiled, bench/decode_split.py: 10.4 against 7.5 ms), and
          // its layers 1.1-1.4x slower at 2-6 rows, 1.05-1.1x at 16-32 (more rows read
          // a chunk's lines again from L2 either way). int4's many-row kernel gained
          // nothing from it there and keeps T0.
          _mm_prefetch(reinterpret_cast<const char*>(rows + I8Panel::kPrefetchRows *
                                                                I8Panel::kRowElems),
                       _MM_HINT_T1);
          w[p] = _mm512_xor_si512(_mm512_permutexvar_epi8(quads, _mm512_loadu_si512(rows)),
                                  flip);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) sum[m][p] = dot_x4(sum[m][p], w[p], xb + m * lda + 4 * s);
      }
      const bool first = kOneBlock || bi == first_block;
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512i offset = _mm512_set1_epi32(128 * g.x_q_sums[m * blocks + bi]);
        const __m512 step = _mm512_set1_ps(g.x_step[m * blocks + bi]);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[m][p], offset));
          part[m][p] = first ? _mm512_mul_ps(dots, step) : _mm512_fmadd_ps(dots, step, part[m][p]);
        }
      }
    }
    // fold_group's arithmetic on 16 columns a register (the same sums)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      __m512 scale = _mm512_set1_ps(1.0f);
      if constexpr (Base::kGroupScales)
        scale = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(g.scales + (p * groups + gi) * kPanel)));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m)
        total[m][p] = Base::kGroupScales ? _mm512_fmadd_ps(part[m][p], scale, total[m][p])
                                         : _mm512_add_ps(total[m][p], part[m][p]);
    }
  }
}

// int8 panels ([K, 16] signed bytes: I8Panel with a scale per column, I8GroupPanel
// with one per group of whole blocks) times x quantized to int8. vpdpbusd takes one
// unsigned operand, and the one it can broadcast from memory is the signed one: the
// weights are made unsigned (w + 128, one xor a load) and x's four inputs come
// straight from memory (dot_x4), so each lane sums (w + 128) x and 128 times the
// block's sum of x (g.x_q_sums, one integer a row and block) comes off at its end:
// sum x w = sum (w + 128) x - 128 sum x. (It was x + 128 against the weights, whose
// sums took one more vpdpbusd a panel row and x one broadcast a row: 14 dot products
// and 6 broadcasts a step of 6 rows and two panels where 12 and none now do; the same
// integers, so the same sums bit for bit.) A 64-byte load is K rows k..k+3 of the
// panel; one vpermb puts each column's four rows in its own 32-bit lane, columns 0-15
// in order.
template <int MR, int NP, typename Base>
__attribute__((target(KVSERVE_VNNI_TARGET))) void micro_dot_i8_vnni(
    int64_t lda, const int8_t* __restrict b, int64_t k_len, const Groups& g,
    float* __restrict c, int64_t ldc, const float* __restrict col_scale,
    const float* __restrict bias, int64_t n_left) {
  const int64_t panel_stride = k_len * I8Panel::kRowElems;
  const int64_t group_len = Base::kGroupScales ? g.len : k_len;
  const int64_t groups = k_len / group_len, blocks = k_len / kDotBlock;
  alignas(64) uint8_t order[64];
  for (int j = 0; j < 16; ++j)
    for (int r = 0; r < 4; ++r) order[4 * j + r] = static_cast<uint8_t>(16 * r + j);
  const __m512i quads = _mm512_load_si512(order);
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int64_t blocks_per_group = group_len / kDotBlock;
  __m512 total[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) total[m][p] = _mm512_setzero_ps();
  if (Base::kGroupScales && blocks_per_group == 1)
    i8_vnni_groups<MR, NP, Base, true>(total, lda, b, panel_stride, g, groups, blocks, 1,
                                       quads, flip);
  else
    i8_vnni_groups<MR, NP, Base, false>(total, lda, b, panel_stride, g, groups, blocks,
                                        blocks_per_group, quads, flip);
  store_totals<MR, NP>(total, c, ldc, col_scale, bias, n_left);
}
