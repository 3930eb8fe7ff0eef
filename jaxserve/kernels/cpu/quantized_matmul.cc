// One layer's projection read in place from GGUF quantized blocks for XLA:CPU, an XLA FFI custom
// call (built and registered by jaxserve/kernels/cpu/library.py; used by
// jaxserve/kernels/matmul.py): out[T, N] = x[T, K] @ dequantize(w[layer]).T, where w is
// [L, N, K / 32 * bytes], for one or more such w of one format side by side in out (a layer's
// q, k and v, or gate and up, in one call): llama.cpp's layout, each output row's 32-value
// blocks along K, as the GGUF file holds them (Q4_0 18 bytes, Q4_1 20, Q8_0 34;
// jaxserve/kernels/matmul.py FORMATS), or jaxserve's int8 storage in the same layout (40 bytes:
// jaxserve/weights/quantize.py).
//
// Why: a decode step of a few sequences is bound by the weights' bytes it streams from memory;
// Q4_1 is 5 bits a weight where f32 is 32. The blocks are dequantized in registers, a vector of
// weights at a time, and never written anywhere (a kernel that widened each block into an f32
// buffer first ran slower than XLA at one row: benchmarks/RESULTS.md, "The layers' projections
// read in place", "Tried and dropped"). Past a tile of rows each block is dequantized once per
// call into a small L2-resident panel that the f32 kernel's register tiles (matmul_tiles.h) run
// every row over (`Rows`): there the rows' FMAs, not the blocks' stream, set the pace, and
// dequantizing per tile of rows did not pay.
//
// Arithmetic, two ways (the `int8_dot` attribute, jaxserve/kernels/matmul.py):
// - f32: each weight as the f32 value the gguf package's dequantization gives (d * q for Q4_0 /
//   Q8_0, exact in f32; d * q + m for Q4_1, d * q exact, one rounding of the sum either way), then
//   f32 FMAs (the int8 storage: fma(code, d, m), one rounding): at up to kTileRows rows each
//   output's lanes sum every kLanes-th product in order along K, the lanes are added at the end;
//   past that (the panel path, always f32) the f32 kernel's sums on the dequantized weights, bit
//   for bit (blocks of kDepth along K, in order).
// - int8 (steps of up to 4 rows, kIntRows; the GGUF formats only): llama.cpp's. Each row of x is
//   rounded once per call to int8 per 32-value block (`Activations`: dx = max|x| / 127, codes
//   rint(x / dx)), and each weight block meets it in an integer dot product (AVX-512 VNNI
//   `vpdpbusd`, two blocks an instruction; AVX-VNNI; AVX2 / AVX-512BW `pmaddubsw` + `pmaddwd`;
//   plain loops in the generic build): the codes as u8 (Q4's nibbles 0..15; Q8_0's |code|, its sign
//   moved onto x's code), x's codes as s8. The block's int32 sums are exact; each is converted once
//   and FMA'd with d_w * dx into f32 accumulators. Q4_0's "- 8" is -8 * sum(x codes) added to the
//   int32 sum; Q4_1's m term is m * (dx * sum(x codes)) (llama.cpp's Q8_1 s: the result is then
//   exactly the dot product of the dequantized weights with the rounded x, up to the f32 scaling).
//   The 8-bit rounding of x moves each output by ~2e-4 of sum |w * x| (random x; f32: ~5e-9),
//   bounded by the sum of dx / 2 * |w| (tests/test_cpu_kernels.py checks both); in exchange a block
//   pair costs ~13 vector instructions an output where widening each vector of weights to f32 took
//   ~32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "matmul_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__) && !defined(__AVX512BW__)
#error "AVX-512F without AVX-512BW (Xeon Phi): build with -mno-avx512f"
#endif
#if defined(__AVX512F__)
constexpr int kLanes = 16, kTileRows = 4, kTileOutputs = 4;
#elif defined(__AVX2__)
constexpr int kLanes = 8, kTileRows = 2, kTileOutputs = 4;
#else
constexpr int kLanes = 4, kTileRows = 2, kTileOutputs = 2;
#endif
constexpr int kBlock = 32;                   // values per block, every format
constexpr int kVecsPerBlock = kBlock / kLanes;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t I32 __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint8_t U8 __attribute__((vector_size(kLanes)));
typedef int8_t I8 __attribute__((vector_size(kLanes)));

// The formats' codes, as jaxserve/kernels/matmul.py FORMATS numbers them.
enum Format : int32_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kInt8 = 3 };

// The f32 value of the f16 with these bits (exact: every f16 is an f32).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f,
                 mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in f32
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Every f16's f32 value, filled when the library loads (256 KiB; the few scales' lines a step
// meets stay in cache). A block's scale is then one broadcast load, where converting it in
// registers took a broadcast and a vcvtph2ps on the shuffle port the codes' widening needs too.
struct HalfTable {
  float value[1 << 16];
  HalfTable() {
    for (uint32_t h = 0; h < (1u << 16); ++h) value[h] = HalfToFloat(static_cast<uint16_t>(h));
  }
};
const HalfTable kHalves;

inline Vec Broadcast(float f) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(f);
#elif defined(__AVX2__)
  return _mm256_set1_ps(f);
#else
  return Vec{f, f, f, f};
#endif
}

// The f16 at p broadcast to every lane as f32.
inline Vec BroadcastHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return Broadcast(kHalves.value[h]);
}

// The f32 at p (unaligned) broadcast to every lane.
inline Vec BroadcastFloat(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return Broadcast(f);
}

// a * b + c rounded once, on every build (what the int8 storage's reference computes).
inline Vec Fma(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  for (int l = 0; l < kLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

// One format's block: its bytes, and its weights [v * kLanes, (v + 1) * kLanes) as f32.
template <Format F>
struct Block;

// Values [v * kLanes, (v + 1) * kLanes) of 16 bytes of nibbles at qs as int32: value j < 16 is
// the low nibble of byte j, value j + 16 its high nibble (Q4_0's and Q4_1's layout).
inline I32 Nibbles(const uint8_t* qs, int v) {
  const int j = v * kLanes;
  U8 q;
  std::memcpy(&q, qs + (j & 15), sizeof(q));
  q = (q >> (j >= 16 ? 4 : 0)) & 15;
  return __builtin_convertvector(q, I32);
}

#if defined(__AVX512F__)
// A Q4 block's 16 possible weights (value i: the weight of nibble i), computed as the other
// builds compute each weight, so the same floats: a vector of weights is then one permute of the
// table by the codes (vpermps reads each lane's low 4 bits: a byte's low nibble as it is, its
// high one after a shift), where widening each code to f32 and scaling it took two more
// instructions a vector.
constexpr Vec kNibbleValues = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline Vec LookUp(const uint8_t* qs, int v, Vec table) {
  const __m512i codes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm512_permutexvar_ps(v == 0 ? codes : _mm512_srli_epi32(codes, 4), table);
}
#endif

// Q4_0: f16 d, then 16 bytes of nibbles (`Nibbles`); weight = d * (nibble - 8).
template <>
struct Block<kQ4_0> {
  static constexpr int kBytes = 18;
#if defined(__AVX512F__)
  struct Scale {
    Vec table;
  };
  static Scale ScaleOf(const uint8_t* b) { return {(kNibbleValues - 8) * BroadcastHalf(b)}; }
  static Vec Weights(const uint8_t* b, int v, const Scale& s) { return LookUp(b + 2, v, s.table); }
#else
  struct Scale {
    Vec d;
  };
  static Scale ScaleOf(const uint8_t* b) { return {BroadcastHalf(b)}; }
  static Vec Weights(const uint8_t* b, int v, const Scale& s) {
    return __builtin_convertvector(Nibbles(b + 2, v) - 8, Vec) * s.d;
  }
#endif
};

// Q4_1: f16 d, f16 m, then the nibbles as Q4_0's; weight = d * nibble + m.
template <>
struct Block<kQ4_1> {
  static constexpr int kBytes = 20;
#if defined(__AVX512F__)
  struct Scale {
    Vec table;
  };
  static Scale ScaleOf(const uint8_t* b) {
    return {kNibbleValues * BroadcastHalf(b) + BroadcastHalf(b + 2)};
  }
  static Vec Weights(const uint8_t* b, int v, const Scale& s) { return LookUp(b + 4, v, s.table); }
#else
  struct Scale {
    Vec d, m;
  };
  static Scale ScaleOf(const uint8_t* b) {
    return {BroadcastHalf(b), BroadcastHalf(b + 2)};
  }
  static Vec Weights(const uint8_t* b, int v, const Scale& s) {
    return __builtin_convertvector(Nibbles(b + 4, v), Vec) * s.d + s.m;
  }
#endif
};

// kLanes bytes at q as int32, sign- or zero-extended. Spelled out: GCC widens
// `__builtin_convertvector` of a vector of 16 int8 a lane at a time, which made a Q8_0 row 4-5x
// slower than a Q4_1 row of the same values (the LM head, 8 of ~20 ms per batch-1 decode step).
template <bool Signed>
inline I32 Widen(const uint8_t* q) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return reinterpret_cast<I32>(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return reinterpret_cast<I32>(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  std::conditional_t<Signed, I8, U8> bytes;
  std::memcpy(&bytes, q, sizeof(bytes));
  return __builtin_convertvector(bytes, I32);
#endif
}

// Q8_0: f16 d, then 32 signed bytes; weight = d * byte.
template <>
struct Block<kQ8_0> {
  static constexpr int kBytes = 34;
  struct Scale {
    Vec d;
  };
  static Scale ScaleOf(const uint8_t* b) { return {BroadcastHalf(b)}; }
  static Vec Weights(const uint8_t* b, int v, const Scale& s) {
    return __builtin_convertvector(Widen<true>(b + 2 + v * kLanes), Vec) * s.d;
  }
};

// jaxserve's int8 storage (jaxserve/weights/quantize.py): f32 d, f32 m, then 32 unsigned bytes;
// weight = fma(byte, d, m). Its groups' f32 scales keep a Q4 source's levels exact (the module).
template <>
struct Block<kInt8> {
  static constexpr int kBytes = 40;
  struct Scale {
    Vec d, m;
  };
  static Scale ScaleOf(const uint8_t* b) { return {BroadcastFloat(b), BroadcastFloat(b + 4)}; }
  static Vec Weights(const uint8_t* b, int v, const Scale& s) {
    return Fma(__builtin_convertvector(Widen<false>(b + 8 + v * kLanes), Vec), s.d, s.m);
  }
};

// The lanes' sum, halves added pairwise: a few shuffles, not a chain of 16 extracts, for each of
// a tile's sums (the wide path's tiles of a short K end often).
inline float Sum(Vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

// Asks for the line a tile two tiles of outputs on will read at this point of its rows (a line
// ahead): a thread's tiles walk its rows in order, and the hardware's prefetcher alone, following
// four rows at once, left the one-row tiles waiting on memory (one-row Q4_1 tiles over 48 MB on
// one thread, host E: 1.3x faster with it, 1.9x with it and the nibbles' table).
inline void Prefetch(const uint8_t* p, int64_t row_bytes) {
  __builtin_prefetch(p + 2 * kTileOutputs * row_bytes + 64, 0, 3);
}

// out[R, O] = x[R, K] @ w[O rows, K].T: R rows of x (stride K) against O output rows of blocks B
// (stride row_bytes); out's row stride ldo.
template <typename B, int R, int O>
void Tile(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* out,
          int64_t ldo) {
  Vec acc[R][O] = {};
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    typename B::Scale scale[O];
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      scale[o] = B::ScaleOf(w + o * row_bytes + b * B::kBytes);
      Prefetch(w + o * row_bytes + b * B::kBytes, row_bytes);
    }
#pragma GCC unroll 8
    for (int v = 0; v < kVecsPerBlock; ++v) {
      Vec wv[O];
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) wv[o] = B::Weights(w + o * row_bytes + b * B::kBytes, v, scale[o]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        Vec xv;
        std::memcpy(&xv, x + r * K + b * kBlock + v * kLanes, sizeof(xv));
#pragma GCC unroll 4
        for (int o = 0; o < O; ++o) acc[r][o] += xv * wv[o];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) out[r * ldo + o] = Sum(acc[r][o]);
  }
}

using TileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t);

// The f32 tiles of blocks B, for TileTable.
template <typename B>
struct FloatTiles {
  using Fn = TileFn;
  template <int R, int O>
  static constexpr Fn kFn = &Tile<B, R, O>;
};

// TileTable<Kind, Rows>::fn[r][o]: Kind's tile of r <= Rows rows of x and o output rows.
template <typename Kind, int Rows>
struct TileTable {
  typename Kind::Fn fn[Rows + 1][kTileOutputs + 1] = {};
  constexpr TileTable() {
    Fill(std::make_integer_sequence<int, Rows>());
  }
  template <int... R>
  constexpr void Fill(std::integer_sequence<int, R...>) {
    (FillOutputs<R + 1>(std::make_integer_sequence<int, kTileOutputs>()), ...);
  }
  template <int R, int... O>
  constexpr void FillOutputs(std::integer_sequence<int, O...>) {
    ((fn[R][O + 1] = Kind::template kFn<R, O + 1>), ...);
  }
};

template <Format F>
using Tiles = TileTable<FloatTiles<Block<F>>, kTileRows>;

// ---- The integer path: x rounded to int8 per block, integer dot products (the header). ----

// Blocks per integer dot product: a 512-bit one takes two blocks' codes, x's in their order.
#if defined(__AVX512F__)
constexpr int kDotBlocks = 2;
#else
constexpr int kDotBlocks = 1;
#endif
constexpr int kDotBytes = kDotBlocks * kBlock;
// Steps of up to this many rows take the integer path (on every build: the same rows round the
// same way whatever the ISA; jaxserve/kernels/matmul.py INT8_DOT_MAX_ROWS).
constexpr int kIntRows = 4;
constexpr int kBlockLanes = kLanes / kDotBlocks;  // a block's int32 / f32 lanes in a dot's result
typedef int8_t Codes __attribute__((vector_size(kDotBytes)));

// x's rows rounded to int8 per block, as llama.cpp's quantize_row_q8_1 does: dx = max|x| / 127
// (f32 division), codes rint(x * (1 / dx)) (ties to even), |code| <= 127. For each row, `steps`
// dot steps of kDotBlocks blocks; an odd block count's last step pads a block of zero codes
// with a zero scale.
struct Activations {
  int64_t blocks, steps;
  std::vector<Codes> codes;  // [T, steps]
  std::vector<Vec> scale;    // [T, steps]: each block's dx in its kBlockLanes lanes
  std::vector<I32> sums;     // [T, steps]: each block's sum of codes in its first lane, 0 after
  std::vector<Vec> offsets;  // [T, steps]: dx * that sum in HeadHalves' lane of m, 0 elsewhere
};

Activations RoundToInt8(const float* x, int64_t T, int64_t K) {
  Activations a;
  a.blocks = K / kBlock;
  a.steps = (a.blocks + kDotBlocks - 1) / kDotBlocks;
  a.codes.assign(T * a.steps, Codes{});
  a.scale.assign(T * a.steps, Vec{});
  a.sums.assign(T * a.steps, I32{});
  a.offsets.assign(T * a.steps, Vec{});
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      const float* v = x + t * K + b * kBlock;
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
      const int64_t step = t * a.steps + b / kDotBlocks, slot = b % kDotBlocks;
      int8_t* codes = reinterpret_cast<int8_t*>(&a.codes[step]) + slot * kBlock;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        codes[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
        sum += codes[j];
      }
      for (int l = 0; l < kBlockLanes; ++l) a.scale[step][slot * kBlockLanes + l] = d;
      a.sums[step][slot * kBlockLanes] = sum;
      a.offsets[step][2 * slot + 1] = d * static_cast<float>(sum);
    }
  }
  return a;
}

// acc + each int32 lane's sum of its 4 (generic: 8) adjacent products u[j] * s[j], u read as
// unsigned bytes, s as signed. |u| <= 128 and |s| <= 127: pmaddubsw's int16 pairs never saturate.
inline I32 DotU8S8(I32 acc, Codes u, Codes s) {
#if defined(__AVX512VNNI__)
  return reinterpret_cast<I32>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc),
                                                   reinterpret_cast<__m512i>(u),
                                                   reinterpret_cast<__m512i>(s)));
#elif defined(__AVX512F__)
  return acc + reinterpret_cast<I32>(_mm512_madd_epi16(
                   _mm512_maddubs_epi16(reinterpret_cast<__m512i>(u), reinterpret_cast<__m512i>(s)),
                   _mm512_set1_epi16(1)));
#elif defined(__AVXVNNI__)
  return reinterpret_cast<I32>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc),
                                                       reinterpret_cast<__m256i>(u),
                                                       reinterpret_cast<__m256i>(s)));
#elif defined(__AVX2__)
  return acc + reinterpret_cast<I32>(_mm256_madd_epi16(
                   _mm256_maddubs_epi16(reinterpret_cast<__m256i>(u), reinterpret_cast<__m256i>(s)),
                   _mm256_set1_epi16(1)));
#else
  constexpr int kPer = kDotBytes / kLanes;
  for (int l = 0; l < kLanes; ++l) {
    for (int j = l * kPer; j < (l + 1) * kPer; ++j) {
      acc[l] += static_cast<uint8_t>(u[j]) * static_cast<int32_t>(s[j]);
    }
  }
  return acc;
#endif
}

// acc + the same sums of w[j] * s[j], both signed: |w| as u8 (-128 too: 0x80 is 128), w's sign
// moved onto s (|s| <= 127, so its negation never overflows).
inline I32 DotS8S8(I32 acc, Codes w, Codes s) {
#if defined(__AVX512F__)
  const __m512i wv = reinterpret_cast<__m512i>(w), sv = reinterpret_cast<__m512i>(s);
  const __m512i signed_s =
      _mm512_mask_sub_epi8(sv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), sv);
  return DotU8S8(acc, reinterpret_cast<Codes>(_mm512_abs_epi8(wv)),
                 reinterpret_cast<Codes>(signed_s));
#elif defined(__AVX2__)
  const __m256i wv = reinterpret_cast<__m256i>(w), sv = reinterpret_cast<__m256i>(s);
  return DotU8S8(acc, reinterpret_cast<Codes>(_mm256_sign_epi8(wv, wv)),
                 reinterpret_cast<Codes>(_mm256_sign_epi8(sv, wv)));
#else
  constexpr int kPer = kDotBytes / kLanes;
  for (int l = 0; l < kLanes; ++l) {
    for (int j = l * kPer; j < (l + 1) * kPer; ++j) acc[l] += w[j] * static_cast<int32_t>(s[j]);
  }
  return acc;
#endif
}

// The two f16 at p (a block's d and the half after it: Q4_1's m) and, with two blocks a dot,
// the two at p + stride, as f32 lanes 0, 1 (and 2, 3); 0 in the other lanes. One conversion for
// a block pair's scales where a broadcast per scale took 3-4 shuffles (the path's largest cost).
inline Vec HeadHalves(const uint8_t* p, int64_t stride) {
#if defined(__AVX512F__)
  int32_t h0, h1;
  std::memcpy(&h0, p, sizeof(h0));
  std::memcpy(&h1, p + stride, sizeof(h1));
  return _mm512_zextps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(h0), h1, 1)));
#elif defined(__AVX2__) && defined(__F16C__)
  (void)stride;
  int32_t h;
  std::memcpy(&h, p, sizeof(h));
  return _mm256_zextps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
#else
  (void)stride;
  Vec v = {};
  v[0] = BroadcastHalf(p)[0];
  v[1] = BroadcastHalf(p + 2)[0];
  return v;
#endif
}

// Each block's d (HeadHalves' lanes 0 and 2) over the block's lanes of a dot's result.
inline Vec BlockScales(Vec heads) {
#if defined(__AVX512F__)
  return _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                               heads);
#elif defined(__AVX2__)
  return _mm256_broadcastss_ps(_mm256_castps256_ps128(heads));
#else
  Vec v;
  for (int l = 0; l < kLanes; ++l) v[l] = heads[0];
  return v;
#endif
}

// The 16 bytes of nibbles at qs (and at qs + stride) as the codes of x's order (`Nibbles`).
inline Codes NibbleCodes(const uint8_t* qs, int64_t stride) {
#if defined(__AVX512F__)
  const __m128i* p0 = reinterpret_cast<const __m128i*>(qs);
  const __m128i* p1 = reinterpret_cast<const __m128i*>(qs + stride);
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(p0))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(p1)), 1);
  // 128-bit lanes: block 0's low nibbles, its high ones, block 1's low, its high.
  const __m512i shifted = _mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0));
  return reinterpret_cast<Codes>(_mm512_and_si512(shifted, _mm512_set1_epi8(15)));
#elif defined(__AVX2__)
  const __m256i both = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i shifted = _mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0));
  return reinterpret_cast<Codes>(_mm256_and_si256(shifted, _mm256_set1_epi8(15)));
#else
  (void)stride;
  Codes c;
  for (int j = 0; j < 16; ++j) {
    c[j] = static_cast<int8_t>(qs[j] & 15);
    c[j + 16] = static_cast<int8_t>(qs[j] >> 4);
  }
  return c;
#endif
}

// 32 signed bytes at q (and at q + stride).
inline Codes ByteCodes(const uint8_t* q, int64_t stride) {
#if defined(__AVX512F__)
  // Two loads into one register (a copy of each half went through the stack: 2x the work).
  return reinterpret_cast<Codes>(_mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + stride)), 1));
#else
  (void)stride;
  Codes c;
  std::memcpy(&c, q, kBlock);
  return c;
#endif
}

// One format's kDotBlocks blocks (the second `stride` bytes after the first) against a row's
// rounded x, into f32 accumulators.
template <Format F>
struct IntBlock;

template <>
struct IntBlock<kQ4_0> {
  struct Weights {
    Vec d;
    Codes q;
  };
  static Weights Load(const uint8_t* b, int64_t stride) {
    return {BlockScales(HeadHalves(b, stride)), NibbleCodes(b + 2, stride)};
  }
  static Vec Add(Vec acc, const Weights& w, Codes x, Vec dx, I32 sums, Vec) {
    const I32 dot = DotU8S8(sums * -8, w.q, x);  // sum((q - 8) * x) with q as 0..15
    return acc + __builtin_convertvector(dot, Vec) * (w.d * dx);
  }
};

template <>
struct IntBlock<kQ4_1> {
  struct Weights {
    Vec d, heads;  // heads: HeadHalves, m in the lanes `Activations::offsets` fill
    Codes q;
  };
  static Weights Load(const uint8_t* b, int64_t stride) {
    const Vec heads = HeadHalves(b, stride);
    return {BlockScales(heads), heads, NibbleCodes(b + 4, stride)};
  }
  static Vec Add(Vec acc, const Weights& w, Codes x, Vec dx, I32, Vec offsets) {
    const I32 dot = DotU8S8(I32{}, w.q, x);
    acc += __builtin_convertvector(dot, Vec) * (w.d * dx);
    return acc + w.heads * offsets;  // m * dx * sum(x codes)
  }
};

template <>
struct IntBlock<kQ8_0> {
  struct Weights {
    Vec d;
    Codes q;
  };
  static Weights Load(const uint8_t* b, int64_t stride) {
    return {BlockScales(HeadHalves(b, stride)), ByteCodes(b + 2, stride)};
  }
  static Vec Add(Vec acc, const Weights& w, Codes x, Vec dx, I32, Vec) {
    return acc + __builtin_convertvector(DotS8S8(I32{}, w.q, x), Vec) * (w.d * dx);
  }
};

// out[R, O] = rounded x[R rows] @ w[O rows of blocks F].T: `Tile` on the integer path.
template <Format F, int R, int O>
void IntTile(const Activations& a, const uint8_t* w, int64_t row_bytes, float* out,
             int64_t ldo) {
  constexpr int64_t kBytes = Block<F>::kBytes;
  Vec acc[R][O] = {};
  for (int64_t s = 0; s < a.steps; ++s) {
    // An odd block count's last step reads its block twice, against zero codes the second time.
    const int64_t stride = (s + 1) * kDotBlocks <= a.blocks ? kBytes : 0;
    typename IntBlock<F>::Weights wb[O];
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      wb[o] = IntBlock<F>::Load(w + o * row_bytes + s * kDotBlocks * kBytes, stride);
      Prefetch(w + o * row_bytes + s * kDotBlocks * kBytes, row_bytes);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * a.steps + s;
      const Codes x = a.codes[i];
      const Vec dx = a.scale[i];
      const I32 sums = a.sums[i];
      const Vec offsets = a.offsets[i];
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) {
        acc[r][o] = IntBlock<F>::Add(acc[r][o], wb[o], x, dx, sums, offsets);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int o = 0; o < O; ++o) out[r * ldo + o] = Sum(acc[r][o]);
  }
}

using IntTileFn = void (*)(const Activations&, const uint8_t*, int64_t, float*, int64_t);

template <Format F>
struct IntTiles {
  using Fn = IntTileFn;
  template <int R, int O>
  static constexpr Fn kFn = &IntTile<F, R, O>;
};

// Output rows per panel of the wide path: kPanelOutputs * K floats (192 KB for K = 1536) stay in
// L2 while the f32 tiles run every row of x over them.
constexpr int kPanelOutputs = 8 * kTileOutputs;

// dst[c, r] = src[r, c] for r < rows, c < cols (row strides lds, ldd): 8 x 8 blocks in registers
// on the AVX2 and AVX-512 builds, 24 shuffles a block; the edges and the generic build a value at
// a time. The wide path transposes x and its sums with it: value by value, x's transpose alone
// took ~15% of a batch-64 down projection, on one thread before the pool starts.
inline void TransposeInto(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                          int64_t ldd) {
  int64_t r0 = 0;
#if defined(__AVX2__)
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      const float* s = src + r0 * lds + c0;
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * lds);
      // Within each 128-bit half: pairs of rows interleaved, then groups of four rows.
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      float* d = dst + c0 * ldd + r0;
      for (int i = 0; i < 4; ++i) {  // rows 0-3's half and rows 4-7's: columns i and i + 4
        _mm256_storeu_ps(d + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(d + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
      }
    }
    for (; c0 < cols; ++c0) {
      for (int64_t r = r0; r < r0 + 8; ++r) dst[c0 * ldd + r] = src[r * lds + c0];
    }
  }
#endif
  for (int64_t r = r0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
}

// x[T, K] transposed for the wide path: xt[K, Tp], Tp = T rounded up to whole vectors (zeros
// past T), so that the f32 kernel's tiles (matmul_tiles.h) take x's rows as their columns.
std::vector<float> Transpose(const float* x, int64_t T, int64_t K, int64_t Tp) {
  std::vector<float> xt(K * Tp, 0.0f);
  TransposeInto(x, K, T, K, xt.data(), Tp);
  return xt;
}

// Output rows [n0, n1) of out[T, N] = x[T, K] @ dequantize(w[N, K]).T, out's rows `ldo` apart.
//
// Up to kTileRows rows of x: one tile of rows per group of outputs, each block dequantized in
// registers. More rows (xt: x transposed, `Transpose`, Tp its row length): kPanelOutputs output
// rows at a time are dequantized once into `panel`, and the f32 kernel's register tiles
// (matmul_tiles.h: 8 x 3 vectors on AVX-512, each weight broadcast to 24 FMAs) compute the
// panel's outputs for every row of x as out.T = panel @ xt, by blocks of kDepth along K. Its sums
// are the f32 kernel's on the dequantized weights, bit for bit: the same products in the same
// order. (Its first form, tiles of 4 rows x 4 outputs each summing along K, ran the batch-64
// step at 0.84x the f32 load's: benchmarks/RESULTS.md, "GGUF blocks: the wide path on the f32
// kernel's tiles".)
// `rounded`: x rounded to int8 (up to kIntRows rows): the integer path's tiles instead.
template <Format F>
void Rows(const float* x, const Activations* rounded, const float* xt, int64_t Tp, int64_t T,
          int64_t K, const uint8_t* w, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  static constexpr Tiles<F> kTiles;
  const int64_t row_bytes = K / kBlock * Block<F>::kBytes;
  if constexpr (F != kInt8) {  // (QuantizedMatmul refuses int8_dot for the int8 storage)
    static constexpr TileTable<IntTiles<F>, kIntRows> kIntTiles;
    if (rounded != nullptr) {
      for (int64_t n = n0; n < n1; n += kTileOutputs) {
        const int64_t outputs = std::min<int64_t>(kTileOutputs, n1 - n);
        kIntTiles.fn[T][outputs](*rounded, w + n * row_bytes, row_bytes, out + n, ldo);
      }
      return;
    }
  }
  if (T <= kTileRows) {
    for (int64_t n = n0; n < n1; n += kTileOutputs) {
      const int64_t outputs = std::min<int64_t>(kTileOutputs, n1 - n);
      kTiles.fn[T][outputs](x, K, w + n * row_bytes, row_bytes, out + n, ldo);
    }
    return;
  }
  namespace jc = jaxserve_cpu;
  using B = Block<F>;
  const int64_t blocks = K / kBlock;
  std::vector<float> panel_buffer(kPanelOutputs * K + kLanes), sums(kPanelOutputs * Tp);
  // Aligned to a vector: the tiles' loads then never split a cache line.
  float* panel = panel_buffer.data() +
                 (-reinterpret_cast<uintptr_t>(panel_buffer.data()) / sizeof(float)) % kLanes;
  // x's rows as the fewest tiles of up to kVecs vectors, split evenly (64 rows: 2 + 2 vectors,
  // not 3 + 1, whose one-vector tile has 8 FMAs a step to the 3-vector tile's 24).
  const int64_t col_vecs = Tp / jc::kLanes, col_tiles = (col_vecs + jc::kVecs - 1) / jc::kVecs;
  for (int64_t n = n0; n < n1; n += kPanelOutputs) {
    const int64_t outputs = std::min<int64_t>(kPanelOutputs, n1 - n);
    for (int64_t o = 0; o < outputs; ++o) {
      const uint8_t* row = w + (n + o) * row_bytes;
      float* dst = panel + o * K;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = row + b * B::kBytes;
        const typename B::Scale scale = B::ScaleOf(block);
#pragma GCC unroll 8
        for (int v = 0; v < kVecsPerBlock; ++v) {
          const Vec wv = B::Weights(block, v, scale);
          std::memcpy(dst + b * kBlock + v * kLanes, &wv, sizeof(wv));
        }
      }
    }
    // sums[o, t] = out[t, n + o]; a block of xt stays in cache while each tile of the panel's
    // rows meets it.
    for (int64_t k = 0; k < K; k += jc::kDepth) {
      const int64_t depth = std::min(jc::kDepth, K - k);
      for (int64_t o = 0; o < outputs; o += jc::kRows) {
        const int64_t rows = std::min<int64_t>(jc::kRows, outputs - o);
        for (int64_t i = 0, t = 0; i < col_tiles; ++i) {
          const int64_t vecs = col_vecs / col_tiles + (i < col_vecs % col_tiles ? 1 : 0);
          jc::kTiles<float>.fn[vecs][rows](panel + o * K + k, K, xt + k * Tp + t, Tp,
                                           sums.data() + o * Tp + t, Tp, depth, k > 0,
                                           jc::Prefetch<float>{});
          t += vecs * jc::kLanes;
        }
      }
    }
    TransposeInto(sums.data(), Tp, outputs, T, out + n, ldo);
  }
}

// One projection's blocks for `Run`: N output rows, written to out's columns [column, column + N).
struct Weight {
  const uint8_t* blocks;
  int64_t N, column;
};

// out[T, sum N] = x @ each weight's rows, side by side. The weights' groups of kTileOutputs rows
// are split as one sequence: one contiguous run per thread, each streaming its own part of the
// bytes, and one call (one wake-up of the pool) for q, k and v or gate and up at one row.
// `int8_dot` and up to kIntRows rows: x is rounded once here, and both threads read it.
template <Format F>
void Run(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K,
         const std::vector<Weight>& weights, float* out, int64_t ldo, bool int8_dot) {
  const bool rounded = int8_dot && T <= kIntRows;
  const Activations rounded_x = rounded ? RoundToInt8(x, T, K) : Activations{};
  std::vector<int64_t> first_group{0};  // the weights' groups numbered one after another
  for (const Weight& w : weights) {
    first_group.push_back(first_group.back() + (w.N + kTileOutputs - 1) / kTileOutputs);
  }
  const int64_t groups = first_group.back();
  // The wide path's x transposed, once per call for both threads.
  const int64_t Tp = (T + jaxserve_cpu::kLanes - 1) / jaxserve_cpu::kLanes * jaxserve_cpu::kLanes;
  const std::vector<float> xt =
      !rounded && T > kTileRows ? Transpose(x, T, K, Tp) : std::vector<float>();
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), groups);
  jaxserve_cpu::ParallelFor(pool, chunks, [&](int64_t i) {
    const int64_t g0 = groups * i / chunks, g1 = groups * (i + 1) / chunks;
    for (size_t j = 0; j < weights.size(); ++j) {
      const int64_t a = std::max(g0, first_group[j]), b = std::min(g1, first_group[j + 1]);
      if (a >= b) continue;
      const Weight& w = weights[j];
      Rows<F>(x, rounded ? &rounded_x : nullptr, xt.data(), Tp, T, K, w.blocks, out + w.column,
              ldo,
              std::min(w.N, (a - first_group[j]) * kTileOutputs),
              std::min(w.N, (b - first_group[j]) * kTileOutputs));
    }
  });
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs ws,
                           ffi::ResultBuffer<ffi::F32> out, int32_t format, int32_t int8_dot) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2 || layer.element_count() != 1 || ws.size() == 0) {
    return ffi::Error::InvalidArgument(
        "quantized matmul: x [T, K], layer [], weights [L, N, bytes]...");
  }
  const int64_t T = xd[0], K = xd[1], l = layer.typed_data()[0];
  int64_t block_bytes;
  switch (format) {
    case kQ4_0: block_bytes = Block<kQ4_0>::kBytes; break;
    case kQ4_1: block_bytes = Block<kQ4_1>::kBytes; break;
    case kQ8_0: block_bytes = Block<kQ8_0>::kBytes; break;
    case kInt8: block_bytes = Block<kInt8>::kBytes; break;
    default: return ffi::Error::InvalidArgument("quantized matmul: unknown format");
  }
  if (format == kInt8 && int8_dot != 0) {
    return ffi::Error::InvalidArgument("quantized matmul: int8_dot takes the GGUF formats only");
  }
  if (K % kBlock != 0) {
    return ffi::Error::InvalidArgument("quantized matmul: K must be whole blocks");
  }
  std::vector<Weight> weights;
  int64_t columns = 0;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(j);
    if (!w.has_value()) return w.error();
    const auto wd = w->dimensions();
    if (wd.size() != 3 || wd[2] != K / kBlock * block_bytes) {
      return ffi::Error::InvalidArgument("quantized matmul: w [L, N, K / 32 * bytes]");
    }
    if (l < 0 || l >= wd[0]) {
      return ffi::Error::InvalidArgument("quantized matmul: layer out of range");
    }
    weights.push_back({w->typed_data() + l * wd[1] * wd[2], wd[1], columns});
    columns += wd[1];
  }
  if (od[0] != T || od[1] != columns) {
    return ffi::Error::InvalidArgument("quantized matmul: out [T, the weights' N summed]");
  }
  if (T == 0 || columns == 0) return ffi::Error::Success();
  const bool int8 = int8_dot != 0;
  switch (format) {
    case kQ4_0: Run<kQ4_0>(pool, x.typed_data(), T, K, weights, out->typed_data(), columns, int8);
      break;
    case kQ4_1: Run<kQ4_1>(pool, x.typed_data(), T, K, weights, out->typed_data(), columns, int8);
      break;
    case kQ8_0: Run<kQ8_0>(pool, x.typed_data(), T, K, weights, out->typed_data(), columns, int8);
      break;
    default: Run<kInt8>(pool, x.typed_data(), T, K, weights, out->typed_data(), columns, false);
      break;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .RemainingArgs()               // w [L, N, K / 32 * bytes]...
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, sum of N]
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("int8_dot"));  // 1: x rounded to int8 (header)
