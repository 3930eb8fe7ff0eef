// Paged attention of decodes and short queries for XLA:CPU, an XLA FFI custom call (built and
// registered by jaxserve/kernels/cpu/library.py, used by jaxserve/kernels/attention/cpu.py).
//
// Sequences of 1 to kMaxQueries queries (a decode, or a decode and its speculative drafts)
// against their pages of the cache, read in place: the tuned XLA path gathers each block of
// pages into a fresh buffer, transposes it for the batched dots and runs its online softmax as a
// while loop of many small XLA ops; here each (sequence, KV head) walks its pages once, its
// scores, softmax state and weighted values in small buffers that stay in L1 (L2 for the longest
// verifies).
// Layout and semantics: the docstring of jaxserve/kernels/attention (K head h at slot 2h,
// V head h at 2h + 1 of a page row). Rows of sequences not selected by `include` come back 0.
// The cache is f32 or bf16 (read as f32, as the XLA path reads it); queries and output are f32.
//
// Also here, for a bf16 cache: the KV write and the page gather of the prefill path. XLA:CPU has
// no bf16 scatter or gather and widens the operand to f32 around one, which for the cache is the
// whole cache, twice per layer (measured: benchmarks/RESULTS.md, "bf16 KV cache on the CPU path").
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu::ExpNonPositive;

constexpr float kMasked = -1e30f;  // the XLA path's running-max start and masked score
// The largest page and the most queries per KV head the kernel takes (cpu.py's `supports`
// checks the same bounds before choosing it).
constexpr int kMaxPage = 64;
constexpr int kMaxGroup = 8;
constexpr int kMaxQueries = 8;  // per sequence: a decode and up to 7 drafts

// A bf16 cache element: the high half of an f32, widened exactly.
struct Bf16 {
  uint16_t bits;
};
inline float ToF32(float x) { return x; }
inline float ToF32(Bf16 x) {
  const uint32_t wide = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}
// Round to nearest even, NaN kept (quietened), as XLA's convert rounds.
inline Bf16 ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}
// One K or V row of a head as f32: the row itself for an f32 cache, else widened into `buf` once,
// not once per query that reads it (measured: benchmarks/RESULTS.md, "bf16 KV cache on the CPU
// path").
template <int D>
inline const float* RowF32(const float* row, float*) {
  return row;
}
template <int D>
inline const float* RowF32(const Bf16* row, float* buf) {
#pragma omp simd
  for (int d = 0; d < D; ++d) buf[d] = ToF32(row[d]);
  return buf;
}
inline void Store(float x, float* dst) { *dst = x; }
inline void Store(float x, Bf16* dst) { *dst = ToBf16(x); }

// Ask for one token's K and V rows of a head (2 * D elements, contiguous).
template <typename T, int D>
inline void PrefetchRow(const T* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int b = 0; b < 2 * D * static_cast<int>(sizeof(T)); b += 64) {
    __builtin_prefetch(bytes + b);
  }
}

// Vectors of kLanes f32 for the scores (see kVectorScores): each (query head, token) dot product
// as a vector of partial sums, and kLanes such vectors summed at once by SumEach, a transpose by
// shuffles, where a horizontal sum per dot costs about as much again as the dot's multiplies.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec LoadLanes(const float* x) { return _mm512_loadu_ps(x); }
inline void StoreLanes(Vec v, float* x) { _mm512_storeu_ps(x, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// Lane j of the result: the sum of v[j]'s lanes. Each level adds pairs of vectors whose halves
// (of a 128-bit lane, then of the register) were interleaved, halving the lanes per dot.
inline Vec SumEach(const Vec* v) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec LoadLanes(const float* x) { return _mm256_loadu_ps(x); }
inline void StoreLanes(Vec v, float* x) { _mm256_storeu_ps(x, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec SumEach(const Vec* v) {
  Vec a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                       _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#else
// Other hosts: the compilers' generic vectors (GCC and Clang), lowered to what the target has.
constexpr int kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
inline Vec Zero() { return Vec{}; }
inline Vec LoadLanes(const float* x) {
  Vec v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
inline void StoreLanes(Vec v, float* x) { std::memcpy(x, &v, sizeof(v)); }
inline Vec Fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec SumEach(const Vec* v) {
  Vec out{};
  for (int j = 0; j < kLanes; ++j) {
    for (int i = 0; i < kLanes; ++i) out[j] += v[j][i];
  }
  return out;
}
#endif
// Whether AttendOne scores kLanes tokens at once (SumEach) or each token with its own horizontal
// sums. The vector scores take less arithmetic, and win wherever that counts: verifies (f32 or
// bf16 cache) and bf16 decodes. An f32 decode is bound by DRAM, and there the scalar scores were
// the faster, for a reason not found. Measured: benchmarks/RESULTS.md, "The scores as vectors of
// partial sums".
template <typename T, bool kDecode>
constexpr bool kVectorScores = !kDecode || !std::is_same_v<T, float>;

// q . k as a vector of partial sums (lanes d, d + kLanes, ...).
template <int D>
inline Vec PartialDot(const float* q, const float* k) {
  Vec acc = Zero();
  for (int c = 0; c < D / kLanes; ++c) {
    acc = Fma(LoadLanes(q + c * kLanes), LoadLanes(k + c * kLanes), acc);
  }
  return acc;
}

// A head's row is a third (SmolLM2) of the token's row, so the hardware sees a strided stream
// that stops at every 4 KiB page: AttendOne asks for the row `ahead` tokens after token `t` of
// this page (`base`, starting at position `first`), or of the next page past this one's end.
// How far ahead: 4 for the scalar scores, 16 for the vector scores, which spend less time per
// token (at 4 they were slower than the scalar scores). The f32 decode is sensitive to the code
// generated here: a lambda capturing the loop's state, or `t + ahead` passed in as one argument
// (one prefetch sequence with a selected base instead of two), were slower; time this function's
// changes with the KV in DRAM. Measured: benchmarks/RESULTS.md, "Row prefetch in the kernel" and
// "The scores as vectors of partial sums".
template <typename T, int D>
inline void PrefetchAhead(const T* base, const T* next_base, int64_t token_stride, int64_t t,
                          int64_t ahead, int64_t first, int64_t len, int64_t ps) {
  if (const int64_t a = t + ahead; first + a < len && a < 2 * ps) {
    PrefetchRow<T, D>(a < ps ? base + a * token_stride : next_base + (a - ps) * token_stride);
  }
}

struct Problem {
  const float* q;        // [T, Hq, D]
  const void* kv;        // [P, page_size, 2 * Hkv, D], f32 or bf16
  const int32_t* kv_lens;
  const int32_t* pages;  // [S, pages_per_seq]
  const int32_t* cu_q_lens;
  const int32_t* include;
  float* out;            // [T, Hq, D]
  int64_t num_pages, page_size, hkv, pages_per_seq;
  float sm_scale, soft_cap;
  int64_t sliding_window;
};

// One (sequence, KV head): its Q <= kMaxQueries queries (a decode, or a decode and its drafts) of
// G heads each, over the sequence's visible positions, a page at a time. Query r sits at position
// len - Q + r and sees the positions up to its own (and, with a window, the last `window` of
// them). D and G are compile-time so the loops over them unroll and each K and V row, loaded
// once, serves all Q * G queries; so is Q for a decode (Q = 1: a loop over a runtime Q slowed
// decodes; measured: benchmarks/RESULTS.md, "Verifies through the kernel too"). T is the cache's
// element type.
template <typename T, int D, int G, bool kDecode>
void AttendOne(const Problem& p, int64_t seq, int64_t h) {
  const T* kv = static_cast<const T*>(p.kv);
  const int64_t ps = p.page_size;
  const int64_t row = p.cu_q_lens[seq];
  const int64_t nq = kDecode ? 1 : p.cu_q_lens[seq + 1] - row;
  const int64_t len = p.kv_lens[seq];
  const int64_t token_stride = 2 * p.hkv * D;
  constexpr int kQ = kDecode ? 1 : kMaxQueries;
  // Positions [lo[r], hi[r]) of query r; the first query's lo is the lowest any query sees. (A
  // query before position 0, kv_len < q_len, sees none and comes back 0, as in the XLA path.)
  int64_t lo[kQ], hi[kQ];
  for (int64_t r = 0; r < nq; ++r) {
    hi[r] = len - nq + r + 1;
    lo[r] = p.sliding_window > 0 ? std::max<int64_t>(0, hi[r] - p.sliding_window) : 0;
  }
  // s: a page's scores, and room for a last block of kLanes past the page's end.
  alignas(64) float q[kQ][G][D], acc[kQ][G][D], s[kQ][G][kMaxPage + kLanes], row_buf[D];
  float m[kQ][G], l[kQ][G];
  for (int64_t r = 0; r < nq; ++r) {
    for (int g = 0; g < G; ++g) {
      const float* src = p.q + ((row + r) * p.hkv * G + h * G + g) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) q[r][g][d] = src[d] * p.sm_scale, acc[r][g][d] = 0.0f;
      m[r][g] = kMasked;
      l[r][g] = 0.0f;
    }
  }
  // Clamped as XLA clamps a gather index: a bad page table, or a kv_len past its row, reads a
  // wrong page, never past the table or the pool.
  const auto page_at = [&](int64_t i) {
    const int64_t entry = std::min(i, p.pages_per_seq - 1);
    return std::clamp<int64_t>(p.pages[seq * p.pages_per_seq + entry], 0, p.num_pages - 1);
  };
  for (int64_t first = lo[0] - lo[0] % ps; first < len; first += ps) {
    const int64_t page = page_at(first / ps);
    const T* base = kv + page * ps * token_stride + 2 * h * D;
    // A page that does not follow this one in memory is one the hardware prefetcher has not
    // seen coming: ask for this head's rows of it while this page is computed. It pays when the
    // pages are spread at random over the pool, and changes nothing when they are in order
    // (measured: benchmarks/RESULTS.md, "Decodes through a C++ kernel").
    const bool has_next = first + ps < len;
    const int64_t next = has_next ? page_at(first / ps + 1) : page;
    const T* next_base = kv + next * ps * token_stride + 2 * h * D;
    if (has_next && next != page + 1) {
      for (int64_t t = 0; t < ps; ++t) PrefetchRow<T, D>(next_base + t * token_stride);
    }
    // This page's tokens [t0, t1) that some query sees; query r sees [r0, r1) of them.
    const int64_t t0 = std::max(first, lo[0]) - first, t1 = std::min(first + ps, len) - first;
    if constexpr (kVectorScores<T, kDecode>) {
      // kLanes tokens at a time: each (query, head)'s dots with them as vectors of partial sums,
      // summed together by SumEach.
      for (int64_t tb = t0; tb < t1; tb += kLanes) {
        const int64_t n = std::min<int64_t>(kLanes, t1 - tb);
        Vec part[kQ][G][kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
          const float* k = j < n ? RowF32<D>(base + (tb + j) * token_stride, row_buf) : nullptr;
          if (k != nullptr) {
            PrefetchAhead<T, D>(base, next_base, token_stride, tb + j, 16, first, len, ps);
          }
          for (int64_t r = 0; r < nq; ++r) {
            for (int g = 0; g < G; ++g) part[r][g][j] = k ? PartialDot<D>(q[r][g], k) : Zero();
          }
        }
        for (int64_t r = 0; r < nq; ++r) {
          for (int g = 0; g < G; ++g) StoreLanes(SumEach(part[r][g]), &s[r][g][tb]);
        }
      }
    } else {
      for (int64_t t = t0; t < t1; ++t) {
        const float* k = RowF32<D>(base + t * token_stride, row_buf);
        PrefetchAhead<T, D>(base, next_base, token_stride, t, 4, first, len, ps);
        for (int g = 0; g < G; ++g) {
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += q[0][g][d] * k[d];
          s[0][g][t] = dot;
        }
      }
    }
    if (p.soft_cap > 0.0f) {
      for (int64_t r = 0; r < nq; ++r) {
        for (int g = 0; g < G; ++g) {
          for (int64_t t = t0; t < t1; ++t) {
            s[r][g][t] = p.soft_cap * std::tanh(s[r][g][t] / p.soft_cap);
          }
        }
      }
    }
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t r0 = std::clamp(lo[r] - first, t0, t1), r1 = std::clamp(hi[r] - first, t0, t1);
      for (int g = 0; g < G; ++g) {
        // Weights of positions this query does not see are 0 (the value loop runs over [t0, t1)).
        for (int64_t t = t0; t < r0; ++t) s[r][g][t] = 0.0f;
        for (int64_t t = std::max(r0, r1); t < t1; ++t) s[r][g][t] = 0.0f;
        if (r0 >= r1) continue;
        float mx = kMasked;
        for (int64_t t = r0; t < r1; ++t) mx = std::max(mx, s[r][g][t]);
        const float m_new = std::max(m[r][g], mx);
        const float alpha = ExpNonPositive(m[r][g] - m_new);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = r0; t < r1; ++t) sum += (s[r][g][t] = ExpNonPositive(s[r][g][t] - m_new));
        l[r][g] = alpha * l[r][g] + sum;
        m[r][g] = m_new;
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[r][g][d] *= alpha;
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = RowF32<D>(base + t * token_stride + D, row_buf);
      for (int64_t r = 0; r < nq; ++r) {
        for (int g = 0; g < G; ++g) {
          const float w = s[r][g][t];
#pragma omp simd
          for (int d = 0; d < D; ++d) acc[r][g][d] += w * v[d];
        }
      }
    }
  }
  for (int64_t r = 0; r < nq; ++r) {
    for (int g = 0; g < G; ++g) {
      float* dst = p.out + ((row + r) * p.hkv * G + h * G + g) * D;
      const float inv = l[r][g] > 0.0f ? 1.0f / l[r][g] : 0.0f;
#pragma omp simd
      for (int d = 0; d < D; ++d) dst[d] = acc[r][g][d] * inv;
    }
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t);

// [G - 1][Q > 1]: the decode and the short-query variant of each group size.
using AttendTable = std::array<std::array<AttendFn, 2>, kMaxGroup>;
template <typename T, int D, int... G>
constexpr AttendTable MakeAttendTable(std::integer_sequence<int, G...>) {
  return {{{AttendOne<T, D, G + 1, true>, AttendOne<T, D, G + 1, false>}...}};
}
// [bf16 cache][D == 128]
constexpr AttendTable kAttend[2][2] = {
    {MakeAttendTable<float, 64>(std::make_integer_sequence<int, kMaxGroup>()),
     MakeAttendTable<float, 128>(std::make_integer_sequence<int, kMaxGroup>())},
    {MakeAttendTable<Bf16, 64>(std::make_integer_sequence<int, kMaxGroup>()),
     MakeAttendTable<Bf16, 128>(std::make_integer_sequence<int, kMaxGroup>())}};

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                       ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                       ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                       ffi::Buffer<ffi::S32> include, ffi::ResultBuffer<ffi::F32> out,
                       float sm_scale, int64_t sliding_window, float soft_cap,
                       int64_t max_queries) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2) {
    return ffi::Error::InvalidArgument("paged decode: q, kv_cache, page_indices ranks");
  }
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[2] / 2, S = pd[0];
  const int64_t G = Hq / Hkv;
  const bool bf16 = kv.element_type() == ffi::DataType::BF16;
  const std::array<AttendFn, 2>* attend =
      (D == 64 || D == 128) && G >= 1 && G <= kMaxGroup ? &kAttend[bf16][D == 128][G - 1]
                                                         : nullptr;
  if (!bf16 && kv.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("paged decode: the cache must be f32 or bf16");
  }
  if (attend == nullptr || kd[3] != D || G * Hkv != Hq || kd[1] > kMaxPage ||
      max_queries < 1 || max_queries > kMaxQueries) {
    return ffi::Error::InvalidArgument(
        "paged decode: head_dim must be 64 or 128, page_size <= " + std::to_string(kMaxPage) +
        ", <= " + std::to_string(kMaxGroup) + " queries per KV head, <= " +
        std::to_string(kMaxQueries) + " queries per sequence");
  }
  std::memset(out->typed_data(), 0, sizeof(float) * T * Hq * D);
  const Problem problem{q.typed_data(), kv.untyped_data(), kv_lens.typed_data(),
                        page_indices.typed_data(), cu_q_lens.typed_data(), include.typed_data(),
                        out->typed_data(), kd[0], kd[1], Hkv, pd[1], sm_scale, soft_cap,
                        sliding_window};
  // Work items (sequence, KV head) of the included sequences.
  std::vector<int32_t> seqs;
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int64_t live = std::min<int64_t>(num_seqs.typed_data()[0], S);
  for (int64_t s = 0; s < live; ++s) {
    const int64_t nq = cu[s + 1] - cu[s];
    if (problem.include[s] && nq >= 1 && nq <= max_queries && lens[s] > 0 && cu[s] >= 0 &&
        cu[s + 1] <= T) {
      seqs.push_back(static_cast<int32_t>(s));
    }
  }
  // Longest first, so the last items to finish are short ones.
  std::sort(seqs.begin(), seqs.end(), [&](int32_t a, int32_t b) { return lens[a] > lens[b]; });
  jaxserve_cpu::ParallelFor(pool, static_cast<int64_t>(seqs.size()) * Hkv, [&](int64_t i) {
    const int64_t seq = seqs[i / Hkv];
    (*attend)[cu[seq + 1] - cu[seq] > 1](problem, seq, i % Hkv);
  });
  return ffi::Error::Success();
}

// rows [T, 2 * Hkv, D] (K and V interleaved, f32) into the cache's token slots `slots` [T]
// (page * page_size + offset); slots past the cache are dropped, as the XLA path's scatter drops
// them, and so are negative ones (which XLA would count from the end; the engine has none). The
// output is the cache, updated in place (aliased by the caller).
template <typename T>
void WriteRows(const float* rows, const int32_t* slots, int64_t num_rows, int64_t row_size,
               int64_t num_slots, T* cache) {
  for (int64_t t = 0; t < num_rows; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) continue;
    T* dst = cache + slots[t] * row_size;
    const float* src = rows + t * row_size;
#pragma omp simd
    for (int64_t i = 0; i < row_size; ++i) Store(src[i], dst + i);
  }
}

ffi::Error WriteKv(ffi::AnyBuffer cache, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> slots,
                   ffi::Result<ffi::AnyBuffer> out) {
  const auto cd = cache.dimensions(), rd = rows.dimensions();
  if (cd.size() != 4 || rd.size() != 3 || rd[1] != cd[2] || rd[2] != cd[3] ||
      slots.element_count() != rd[0] || out->untyped_data() != cache.untyped_data()) {
    return ffi::Error::InvalidArgument("write kv: shapes, or the output not the cache");
  }
  const int64_t row_size = cd[2] * cd[3], num_slots = cd[0] * cd[1];
  switch (cache.element_type()) {
    case ffi::DataType::F32:
      WriteRows(rows.typed_data(), slots.typed_data(), rd[0], row_size, num_slots,
                static_cast<float*>(out->untyped_data()));
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      WriteRows(rows.typed_data(), slots.typed_data(), rd[0], row_size, num_slots,
                static_cast<Bf16*>(out->untyped_data()));
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("write kv: the cache must be f32 or bf16");
  }
}

// The pages `pages` [N] of the cache, widened to f32: [N, page_size, 2 * Hkv, D]. Indices are
// clamped into the cache, as XLA clamps a gather's (a negative one, which XLA would count from
// the end, reads page 0, the engine's null page).
template <typename T>
void GatherRows(const T* cache, const int32_t* pages, int64_t num, int64_t page_elems,
                int64_t num_pages, float* out) {
  for (int64_t i = 0; i < num; ++i) {
    const T* src = cache + std::clamp<int64_t>(pages[i], 0, num_pages - 1) * page_elems;
    float* dst = out + i * page_elems;
#pragma omp simd
    for (int64_t e = 0; e < page_elems; ++e) dst[e] = ToF32(src[e]);
  }
}

ffi::Error GatherPages(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> pages,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto cd = cache.dimensions();
  const int64_t page_elems = cd.size() == 4 ? cd[1] * cd[2] * cd[3] : 0;
  if (page_elems == 0 || cd[0] < 1 ||
      out->element_count() != pages.element_count() * page_elems) {
    return ffi::Error::InvalidArgument("gather pages: shapes");
  }
  switch (cache.element_type()) {
    case ffi::DataType::F32:
      GatherRows(static_cast<const float*>(cache.untyped_data()), pages.typed_data(),
                 pages.element_count(), page_elems, cd[0], out->typed_data());
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      GatherRows(static_cast<const Bf16*>(cache.untyped_data()), pages.typed_data(),
                 pages.element_count(), page_elems, cd[0], out->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("gather pages: the cache must be f32 or bf16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // kv_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rows
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots
                                  .Ret<ffi::AnyBuffer>());        // kv_cache (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGatherPages, GatherPages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pages
                                  .Ret<ffi::Buffer<ffi::F32>>());  // f32 pages

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // kv_cache, f32 or bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // include
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("max_queries"));
