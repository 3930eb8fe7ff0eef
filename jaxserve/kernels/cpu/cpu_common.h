// What the CPU kernels (attention.cc, sampling.cc, matmul.cc) share: a vectorisable exp and a
// loop over work items on XLA's intra-op thread pool.
#ifndef JAXSERVE_KERNELS_CPU_COMMON_H_
#define JAXSERVE_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

// exp(x) for x <= 0 (values minus their max): 2^n * 2^f with a degree-6 polynomial for 2^f, f in
// [-0.5, 0.5]; relative error ~1e-7, as XLA's own vectorised exp. Written so the compiler
// vectorises loops over it (no libm call).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  float t = x * 1.44269504088896341f;  // log2(e)
  float n = std::nearbyint(t);
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// item(i) for i in [0, num_items), on the caller and up to pool.num_threads() - 1 of the pool's
// workers, which claim items through an atomic cursor; returns once every item is done.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t num_items,
                        std::function<void(int64_t)> item) {
  struct Work {
    std::function<void(int64_t)> item;
    int64_t num_items;
    std::atomic<int64_t> next{0}, done{0};
    void Run() {
      for (int64_t i; (i = next.fetch_add(1)) < num_items;) {
        item(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto work = std::make_shared<Work>();
  work->item = std::move(item);
  work->num_items = num_items;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < num_items) std::this_thread::yield();
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_KERNELS_CPU_COMMON_H_
