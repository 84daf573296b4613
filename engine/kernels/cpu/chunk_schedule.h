// How a layer's output panels are shared among torch's threads, for the GEMM kernels
// (bf16_pairs.cpp, packed_gemm.cpp): in chunks of panels, each chunk's weights read
// once for every row of x.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvserve_cpu {

// With at least this many chunks a thread, chunks go to whichever thread is free (a
// counter), not in equal ranges fixed up front: on a shared host one core is often
// slower for a while, and its twin waited in the join (21% of a 1B batch-1 step's
// main thread, in libgomp; taken from a counter, a 1B model's batch-1 products took
// 0.94x the time, bench/bf16_pairs_ab.py). With fewer, equal ranges balance better
// than whole chunks could (36 panels in chunks of 8: 18 a thread, against 20 and 16).
constexpr int64_t kTakenChunksPerThread = 4;

// f(c0, c1) for chunks [c0, c1) of at most `chunk` panels covering [0, panels), each
// on one of torch's threads.
template <typename F>
void for_each_chunk(int64_t panels, int64_t chunk, const F& f) {
  const int64_t chunks = (panels + chunk - 1) / chunk;
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && chunks >= kTakenChunksPerThread * threads && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t c = next++; c < chunks; c = next++)
        f(c * chunk, std::min(panels, (c + 1) * chunk));
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = begin; c0 < end; c0 += chunk) f(c0, std::min(end, c0 + chunk));
  });
}

}  // namespace kvserve_cpu
