// The top-k and top-p thresholds of the sampler's rows for XLA:CPU, an XLA FFI custom call
// (built and registered by jaxserve/kernels/cpu/library.py; used by jaxserve/executor/sampler.py).
//
// Per row of scaled logits: top-k keeps the values >= the k-th largest finite one (ties too);
// top-p then keeps, of those, the values >= the largest t whose values >= t weigh at least top_p
// of the kept mass (weights exp(v - max)). The row's threshold is the larger of the two, -inf
// for a filter that is off (top_k <= 0, top_p >= 1). The sampler's pure-JAX path finds the same
// thresholds by 32 bisection passes over the whole row, each a full read of [rows, vocabulary],
// several times slower on a CPU than this kernel (measured: benchmarks/RESULTS.md, "The sampler's
// top-k and top-p on the CPU"). Here each row counts its values (top-k) or sums their weights
// (top-p) into 4096 buckets by value, which finds the bucket holding the threshold; only that
// bucket's values are then ordered. Exact: a row keeps what a float64 reference keeps
// (tests/test_cpu_kernels.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Values into kBuckets buckets of equal width between the largest value `top` (bucket 0) and
// the smallest, `low`: bucket b holds the values in (top - (b + 1) * width, top - b * width].
// Float arithmetic is monotone, so a larger value never lands in a later bucket, and the same
// value always lands in the same one.
constexpr int kBuckets = 4096;

struct Buckets {
  float top, scale;
  Buckets(float top, float low) : top(top), scale(top > low ? kBuckets / (top - low) : 0.0f) {}
  int operator()(float v) const {  // clamped as a float first: the product may overflow
    return static_cast<int>(std::min((top - v) * scale, static_cast<float>(kBuckets - 1)));
  }
};

// The k-th largest of vals[0, n) (1 <= k <= n; the values lie in [low, top]): the bucket it
// falls in by counts, then a selection among that bucket's values alone.
float KthLargest(const float* vals, int64_t n, int64_t k, float top, float low,
                 std::vector<float>& scratch) {
  const Buckets bucket(top, low);
  int64_t counts[kBuckets] = {};
  for (int64_t i = 0; i < n; ++i) ++counts[bucket(vals[i])];
  int b = 0;
  for (; k > counts[b]; ++b) k -= counts[b];
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (bucket(vals[i]) == b) scratch[m++] = vals[i];
  }
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.begin() + m,
                   std::greater<float>());
  return scratch[k - 1];
}

// The largest value t of vals[0, n) (in [low, top]) with sum(w[i] for vals[i] >= t) >= target,
// 0 < target: the bucket where the mass from the top reaches the target, then that bucket's
// values in order. (Where rounding leaves the target above the whole mass: the smallest value,
// keeping all.)
float ThresholdByMass(const float* vals, const float* w, int64_t n, double target, float top,
                      float low) {
  const Buckets bucket(top, low);
  double mass[kBuckets] = {};
  for (int64_t i = 0; i < n; ++i) mass[bucket(vals[i])] += w[i];
  double above = 0.0;  // the mass of the buckets before b
  int b = 0;
  for (; b < kBuckets - 1 && above + mass[b] < target; ++b) above += mass[b];
  thread_local std::vector<std::pair<float, float>> in_bucket;  // (value, weight): one bucket's
  in_bucket.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (bucket(vals[i]) == b) in_bucket.emplace_back(vals[i], w[i]);
  }
  std::sort(in_bucket.begin(), in_bucket.end(), std::greater<>());
  for (const auto& [v, weight] : in_bucket) {
    if ((above += weight) >= target) return v;
  }
  return in_bucket.empty() ? low : in_bucket.back().first;
}

// One row's threshold; vals and w are scratch of at least `size` floats.
float RowThreshold(const float* row, int64_t size, int32_t top_k, float top_p,
                   std::vector<float>& vals, std::vector<float>& w) {
  const bool use_k = top_k > 0, use_p = top_p < 1.0f;
  if (!use_k && !use_p) return kNegInf;
  int64_t n = 0;
  float top = kNegInf, low = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < size; ++i) {
    if (std::isfinite(row[i])) {
      vals[n++] = row[i];
      top = std::max(top, row[i]), low = std::min(low, row[i]);
    }
  }
  if (n == 0) return kNegInf;
  float threshold = kNegInf;
  if (use_k && top_k < n) {
    threshold = KthLargest(vals.data(), n, top_k, top, low, w);
    n = std::remove_if(vals.begin(), vals.begin() + n, [&](float v) { return v < threshold; }) -
        vals.begin();
  }
  if (!use_p) return threshold;
  // In double: a float sum over a 49k vocabulary is off by ~1e-6 of the mass, enough to move the
  // boundary by a token in ~1% of rows (against a float64 reference).
  double mass = 0.0;
#pragma omp simd reduction(+ : mass)
  for (int64_t i = 0; i < n; ++i) mass += (w[i] = jaxserve_cpu::ExpNonPositive(vals[i] - top));
  const double target = top_p * mass;
  // Values below `lower` weigh less than (1 - top_p) of the mass together (each under
  // (1 - top_p) * mass / n), so the threshold is above them: drop them before the selection.
  // (A margin of 1e-3 covers the rounding of exp and log.)
  const double bound = (1.0 - top_p) * mass / n;
  const float lower =
      bound > 0.0 ? top + static_cast<float>(std::log(bound)) - 1e-3f : kNegInf;
  int64_t kept = 0;
  low = top;
  for (int64_t i = 0; i < n; ++i) {
    if (vals[i] >= lower) {
      low = std::min(low, vals[i]);
      vals[kept] = vals[i], w[kept] = w[i], ++kept;
    }
  }
  return std::max(threshold, ThresholdByMass(vals.data(), w.data(), kept, target, top, low));
}

ffi::Error Thresholds(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scaled,
                      ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = scaled.dimensions();
  if (dims.size() != 2 || top_k.element_count() != dims[0] ||
      top_p.element_count() != dims[0]) {
    return ffi::Error::InvalidArgument("sampling thresholds: scaled [S, V], top_k and top_p [S]");
  }
  const int64_t rows = dims[0], size = dims[1];
  const float* x = scaled.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* p = top_p.typed_data();
  float* t = out->typed_data();
  jaxserve_cpu::ParallelFor(pool, rows, [=](int64_t r) {
    thread_local std::vector<float> vals, w;
    if (static_cast<int64_t>(vals.size()) < size) vals.resize(size), w.resize(size);
    t[r] = RowThreshold(x + r * size, size, k[r], p[r], vals, w);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSamplingThresholds, Thresholds,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scaled logits [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [S]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // thresholds [S]
