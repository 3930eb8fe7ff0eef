// The experts' grouped matmul of a mixture-of-experts layer for XLA:CPU, an XLA FFI custom call
// (built and registered by jaxserve/kernels/cpu/library.py; used by
// jaxserve/executor/models/moe.py through jaxserve/kernels/grouped_matmul.py):
// out[rows of group g] = x[rows of group g] @ w[layer, g] for x [R, K] sorted by group,
// group_sizes [G] and w [L, G, K, N] (f32, or bf16 widened in registers: matmul_tiles.h) read in
// place; rows past the groups' sum are zeros.
//
// Why: XLA:CPU lowers ragged_dot to every row times every expert, and a loop of XLA dots over
// tiles of one expert's rows pays a loop step (and a read of that expert's weights) per tile,
// after the scan has copied the layer's whole stack of experts out of the layers' stack. Here one
// call covers every group: each expert present has its weights read once, in place, by the
// stacked matmul's tiles and panel loop (matmul_tiles.h), and absent experts are never read.
// Work items are (group, run of column panels): the panels of one group split over the threads,
// so one group holding every row still uses them all, and no weight is read twice.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "matmul_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve_cpu::kLanes;
using jaxserve_cpu::kPanel;

namespace {

template <typename W>
// The groups present ((group, first row) each) through layer wl's experts.
void Run(ffi::ThreadPool& pool, const float* x,
         const std::vector<std::pair<int64_t, int64_t>>& present, const int32_t* group_sizes,
         int64_t K, const W* wl, int64_t N, float* o) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), panels);
  jaxserve_cpu::ParallelFor(pool, static_cast<int64_t>(present.size()) * chunks, [&](int64_t i) {
    const auto [g, first] = present[i / chunks];
    const int64_t c = i % chunks;
    jaxserve_cpu::Panels(x + first * K, group_sizes[g], K, wl + g * K * N, N, o + first * N,
                         panels * c / chunks, panels * (c + 1) / chunks);
  });
}

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> group_sizes,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || layer.element_count() != 1 || xd[1] != wd[2] ||
      group_sizes.element_count() != static_cast<size_t>(wd[1])) {
    return ffi::Error::InvalidArgument(
        "grouped matmul: x [R, K], w [L, G, K, N], layer [], group_sizes [G]");
  }
  if (w.element_type() != ffi::F32 && w.element_type() != ffi::BF16) {
    return ffi::Error::InvalidArgument("grouped matmul: w must be f32 or bf16");
  }
  const int64_t R = xd[0], K = xd[1], L = wd[0], G = wd[1], N = wd[3];
  if (N % kLanes != 0) {
    return ffi::Error::InvalidArgument("grouped matmul: N must be a multiple of the vector width");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("grouped matmul: layer out of range");
  // The groups present: (group, first row); their rows must lie within x.
  std::vector<std::pair<int64_t, int64_t>> present;
  int64_t end = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t size = group_sizes.typed_data()[g];
    if (size < 0 || size > R - end) {
      return ffi::Error::InvalidArgument("grouped matmul: group sizes negative or over the rows");
    }
    if (size > 0) present.emplace_back(g, end);
    end += size;
  }
  float* o = out->typed_data();
  std::memset(o + end * N, 0, sizeof(float) * (R - end) * N);
  if (present.empty() || N == 0) return ffi::Error::Success();
  const int64_t offset = l * G * K * N;
  if (w.element_type() == ffi::BF16) {
    Run(pool, x.typed_data(), present, group_sizes.typed_data(), K,
        w.reinterpret_data<jaxserve_cpu::Bf16>() + offset, N, o);
  } else {
    Run(pool, x.typed_data(), present, group_sizes.typed_data(), K, w.typed_data<float>() + offset,
        N, o);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGroupedMatmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [R, K]
                                  .Arg<ffi::AnyBuffer>()          // w f32 / bf16 [L, G, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // group_sizes [G]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [R, N]
