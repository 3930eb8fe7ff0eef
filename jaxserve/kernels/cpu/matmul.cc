// One layer's projection out of a stack of layers' weights for XLA:CPU, an XLA FFI custom call
// (built and registered by jaxserve/kernels/cpu/library.py; used by
// jaxserve/executor/models/llama.py):
// out[T, N] = x[T, K] @ w[layer] where w is [L, K, N] (f32, or bf16 widened in registers), read
// in place.
//
// Why: a decode step's matmuls have few rows (one per sequence) and every step reads all the
// layers' weights from memory (425 MB for SmolLM2 in f32, far over any cache). Through XLA the
// scan over the layers first copies each layer's slice out of the stack (a memory-bound copy) and
// then runs the dots on the copy; dots reading the weights from memory themselves run slower
// still (measured: benchmarks/RESULTS.md, "The layers' projections read in place"). Here the
// weights stream from memory while the cores compute: each thread owns a contiguous run of column
// panels, and while it computes one block of a panel it prefetches the block it computes next
// (the tiles and the panels' loop: matmul_tiles.h).
#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "matmul_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve_cpu::kLanes;
using jaxserve_cpu::kPanel;

namespace {

template <typename W>
void Run(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K, const W* w, int64_t N,
         float* out) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // One contiguous run of panels per thread, so each prefetches what it reads next.
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), panels);
  jaxserve_cpu::ParallelFor(pool, chunks, [&](int64_t i) {
    jaxserve_cpu::Panels(x, T, K, w, N, out, panels * i / chunks, panels * (i + 1) / chunks);
  });
}

ffi::Error StackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || layer.element_count() != 1 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("stacked matmul: x [T, K], w [L, K, N], layer []");
  }
  if (w.element_type() != ffi::F32 && w.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("stacked matmul: w must be f32 or bf16");
  }
  const int64_t T = xd[0], K = xd[1], L = wd[0], N = wd[2];
  if (N % kLanes != 0) {
    return ffi::Error::InvalidArgument("stacked matmul: N must be a multiple of the vector width");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("stacked matmul: layer out of range");
  if (T == 0 || N == 0) return ffi::Error::Success();
  if (w.element_type() == ffi::BF16) {
    Run(pool, x.typed_data(), T, K, w.reinterpret_data<jaxserve_cpu::Bf16>() + l * K * N, N,
        out->typed_data());
  } else {
    Run(pool, x.typed_data(), T, K, w.typed_data<float>() + l * K * N, N, out->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveStackedMatmul, StackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, K]
                                  .Arg<ffi::AnyBuffer>()          // w f32 / bf16 [L, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, N]
