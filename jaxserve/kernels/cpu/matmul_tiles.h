// The f32 matmul's register tiles and its loop over column panels, shared by the stacked-weights
// projection (matmul.cc) and the experts' grouped matmul (grouped_matmul.cc): Panels computes
// out[T, N] = x[T, K] @ w[K, N] for a run of N's column panels, each block of weights read from
// memory once while the next one is prefetched.
//
// Weights are f32 (W = float) or bf16 (W = Bf16, its bits): bf16 widens to f32 exactly (a 16-bit
// shift), in registers as it is loaded, so a bf16 checkpoint's weights stream half the bytes and
// give the sums their f32 widening gives.
//
// Arithmetic: f32 FMAs in order within each block of kDepth contraction rows, the blocks' sums
// then added in order (a plain running sum over K = 1536 loses ~3x the precision).
#ifndef JAXSERVE_KERNELS_CPU_MATMUL_TILES_H_
#define JAXSERVE_KERNELS_CPU_MATMUL_TILES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace jaxserve_cpu {

// A tile is kRows rows by kVecs vectors of kLanes floats in registers (AVX-512: 24 of 32 zmm;
// AVX2: 12 of 16 ymm, leaving room for the weights' two vectors, so a step of k loads 2 + 6 for 12
// FMAs, where a 4 x 3 tile read its weights again for each FMA and ran well below this one;
// measured: benchmarks/RESULTS.md, "The AVX2 build").
#if defined(__AVX512F__)
constexpr int kLanes = 16, kRows = 8, kVecs = 3;
#elif defined(__AVX2__)
constexpr int kLanes = 8, kRows = 6, kVecs = 2;
#else
constexpr int kLanes = 4, kRows = 4, kVecs = 2;
#endif
constexpr int64_t kPanel = kVecs * kLanes;  // columns per panel
// Contraction rows per block: a panel's block of weights (AVX-512: 256 x 48 floats, 48 KiB) is
// read from memory once, by the first row tile, and from cache by the others.
constexpr int64_t kDepth = 256;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Bf16;  // a bf16 value's bits: the high half of its f32's

// kLanes weights from w, as f32.
inline Vec LoadWeights(const float* w) {
  Vec v;
  std::memcpy(&v, w, sizeof(Vec));
  return v;
}
inline Vec LoadWeights(const Bf16* w) {
  // Zero-extended and shifted (AVX-512: vpmovzxwd + vpslld, one load of 32 bytes).
  typedef uint16_t Half __attribute__((vector_size(kLanes * sizeof(Bf16))));
  typedef uint32_t Wide __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Half h;
  std::memcpy(&h, w, sizeof(Half));
  const Wide bits = __builtin_convertvector(h, Wide) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof(Vec));
  return v;
}

// Rows of weights to prefetch while a block computes: the thread's next block.
template <typename W>
struct Prefetch {
  const W* w = nullptr;  // its first row, or null for none
  int64_t rows = 0, vecs = 0;
};

// out[R, V * kLanes] (+)= x[R, depth] @ w[depth, V * kLanes]; row strides ldx, ldw, ldo.
template <typename W, int R, int V>
inline void Tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* out, int64_t ldo,
                 int64_t depth, bool accumulate, const Prefetch<W>& next) {
  // The loops unrolled whole and each x broadcast straight from memory, so the accumulators
  // stay in registers: without that GCC 12's AVX2 build kept them on the stack, at a fraction of
  // the AVX-512 build's rate (measured: benchmarks/RESULTS.md, "The AVX2 build").
  Vec acc[R][V] = {};
  for (int64_t k = 0; k < depth; ++k) {
    Vec b[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) b[v] = LoadWeights(w + k * ldw + v * kLanes);
    if (k < next.rows) {
      for (int64_t v = 0; v < next.vecs; ++v) __builtin_prefetch(next.w + k * ldw + v * kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      if (accumulate) {  // the block's sum added whole: summed by blocks, as XLA's dots sum
        Vec sum;
        std::memcpy(&sum, out + r * ldo + v * kLanes, sizeof(Vec));
        acc[r][v] += sum;
      }
      std::memcpy(out + r * ldo + v * kLanes, &acc[r][v], sizeof(Vec));
    }
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, bool,
                        const Prefetch<W>&);

template <typename W, int V, int... R>
constexpr void FillRows(TileFn<W> (&row)[kRows + 1], std::integer_sequence<int, R...>) {
  ((row[R + 1] = &Tile<W, R + 1, V>), ...);
}

// kTiles<W>.fn[v][r]: the tile of r rows and v vectors.
template <typename W>
struct Tiles {
  TileFn<W> fn[kVecs + 1][kRows + 1] = {};
  constexpr Tiles() : Tiles(std::make_integer_sequence<int, kVecs>()) {}
  template <int... V>
  constexpr explicit Tiles(std::integer_sequence<int, V...>) {
    (FillRows<W, V + 1>(fn[V + 1], std::make_integer_sequence<int, kRows>()), ...);
  }
};
template <typename W>
inline constexpr Tiles<W> kTiles;

// A bf16 block that kWidenOnceRows rows or more read, widened once into this thread's f32 copy
// (kDepth x kPanel floats, 48 KiB on AVX-512: it stays in L2) for the f32 tiles to run over:
// widened in each tile instead, the conversions took ~15% of a compute-bound step (64-256 rows;
// benchmarks/RESULTS.md, "bf16 weights read as bf16"); below 4 tiles the copy's stores and
// loads cost about what they save. The same FMAs in the same order, so the same floats.
// Prefetches `next` as it streams the block.
constexpr int64_t kWidenOnceRows = 4 * kRows;
inline const float* Widened(const Bf16* w, int64_t ldw, int64_t depth, int64_t vecs,
                            const Prefetch<Bf16>& next) {
  alignas(64) static thread_local float block[kDepth * kPanel];
  for (int64_t k = 0; k < depth; ++k) {
    for (int64_t v = 0; v < vecs; ++v) {
      const Vec b = LoadWeights(w + k * ldw + v * kLanes);
      std::memcpy(block + k * kPanel + v * kLanes, &b, sizeof(Vec));
    }
    if (k < next.rows) {
      for (int64_t v = 0; v < next.vecs; ++v) __builtin_prefetch(next.w + k * ldw + v * kLanes);
    }
  }
  return block;
}

// Panels [p0, p1) of out[T, N] = x[T, K] @ w[K, N], a block of kDepth contraction rows at a
// time across all of them: the rows of w are then read along their run of columns, which streams
// from memory faster than one panel down all of K, most at 8-16 rows (measured:
// benchmarks/RESULTS.md, "Then: a block of rows across all panels").
template <typename W>
inline void Panels(const float* x, int64_t T, int64_t K, const W* w, int64_t N, float* out,
                   int64_t p0, int64_t p1) {
  auto vecs = [N](int64_t p) { return std::min<int64_t>(kVecs, (N - p * kPanel) / kLanes); };
  for (int64_t k = 0; k < K; k += kDepth) {
    const int64_t depth = std::min(kDepth, K - k);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel;
      Prefetch<W> next;  // the next panel's block, else the first panel's next block
      if (p + 1 < p1) {
        next = {w + k * N + n + kPanel, depth, vecs(p + 1)};
      } else if (k + kDepth < K) {
        next = {w + (k + kDepth) * N + p0 * kPanel, std::min(kDepth, K - k - kDepth), vecs(p0)};
      }
      if constexpr (std::is_same_v<W, Bf16>) {
        if (T >= kWidenOnceRows) {
          const float* block = Widened(w + k * N + n, N, depth, vecs(p), next);
          for (int64_t m = 0; m < T; m += kRows) {
            const int64_t rows = std::min<int64_t>(kRows, T - m);
            kTiles<float>.fn[vecs(p)][rows](x + m * K + k, K, block, kPanel, out + m * N + n, N,
                                            depth, k > 0, Prefetch<float>{});
          }
          continue;
        }
      }
      for (int64_t m = 0; m < T; m += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, T - m);
        kTiles<W>.fn[vecs(p)][rows](x + m * K + k, K, w + k * N + n, N, out + m * N + n, N,
                                    depth, k > 0, m == 0 ? next : Prefetch<W>{});
      }
    }
  }
}

}  // namespace jaxserve_cpu

#endif  // JAXSERVE_KERNELS_CPU_MATMUL_TILES_H_
