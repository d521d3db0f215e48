// Packed-weight GEMM for XLA:CPU as an XLA FFI custom call: out[M, N] = x[M, K] . w[K, N], w packed once at load.
//
// Why: XLA:CPU's dot libraries get the weight in its stored [K, N] layout on every call and must pack (and, for
// bfloat16, k-pair interleave) it each time or read it with strided panel loads; here the weight was packed once
// (pallas_kernels/cpu/gemm.py) into column panels of NR = 2 vectors, each a contiguous [K, NR] block, so every
// weight byte is read once per call, sequentially, and reused from L1 by all the rows.
//
// Layouts (NR = 2 * W: 32 columns on the AVX-512 path, 16 on AVX2, 8 generic; PanelWidth() reports it):
//   x      [M, K]                 float32 or bfloat16 (M = rows, 1..any)
//   packed [P, K, NR]             float32: panel p holds columns p*NR .. p*NR+NR-1, zero past N
//          [P, ceil(K/2), NR, 2]  bfloat16: k-pairs interleaved per column (the vdpbf16ps operand), zero past N/K
//   out    [M, N]                 x's dtype or float32; accumulated in float32, rounded once (nearest even) to
//                                 bfloat16
// The int8 (w8a8) product, a second target (PackedGemmInt8): out[M, N] int32 = xq[M, K] . w[K, N] exactly, for int8
// activations xq (quantized per token by the caller) and int8 weights:
//   x      [M, K]                 uint8: xq + 128 (the caller's offset, so that x is vpdpbusd's unsigned operand)
//   packed [P, ceil(K/4), NR, 4]  int8: k-quads interleaved per column (vpdpbusd's signed operand), zero past N/K
//   comp   [P * NR]               int32: 128 * sum_k w[k, n] (packed once with the weight), subtracted from every
//                                 row's sum of (xq + 128) * w, which leaves sum xq * w; zero past N
//   out    [M, N]                 int32, exact (K <= kMaxInt8K: no int32 sum can overflow)
// VNNI (AVX-512 VNNI) multiplies the quads with vpdpbusd; elsewhere the quads are widened to int16 pairs and
// multiplied with vpmaddwd (AVX-512BW, AVX2) or GCC vector arithmetic (generic): the same integers either way.
// Work: panels are the items of parallel_for (columns split over XLA's intra-op threads), one pass over them per
// kMaxRows rows of x. Within a panel, K is cut
// into blocks of kPanelBlockBytes (a block stays in L1 while every MR-row register tile of x runs over it); the
// tiles accumulate in a float32 [M, NR] buffer between blocks (L1/L2 resident) and are rounded out at the end.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pja {
namespace {

constexpr int NR = 2 * W;
// Rows per register tile: MR x 2 accumulators + 2 weight vectors + a broadcast fit the path's registers.
constexpr int MR = W == 16 ? 12 : 6;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
// The int8 tile's rows: without VNNI it also holds the weight quads widened to 4 vectors of int16 pairs and two
// activation pairs, so 16-register paths take 4 rows.
constexpr int MR8 = W == 16 ? 12 : 4;
// The int8 product's longest K: 65536 * 255 * 128 < 2^31, so the offset sums never overflow int32.
constexpr int64_t kMaxInt8K = 65536;
constexpr int64_t kPanelBlockBytes = 16 * 1024;
// Rows per pass over the weight: a pass's x rows and its [rows, NR] accumulators stay in L2 (longer inputs, a
// prefill chunk, run in passes of this many rows).
constexpr int64_t kMaxRows = 512;

// *p in every lane, as one broadcast load (simd.h's splat adds a zero first, an extra uop per broadcast here).
inline vf broadcast(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(*p));
#elif defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_broadcast_ss(p));
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = *p;
  return v;
#endif
}

// Prefetches (into L2) the panel data one k step (float32) or k-pair step (bfloat16) reads, `pf` being the same
// offset in the block read next: fetched while this block computes, so the next block's first tile does not wait
// on memory.
template <typename T>
inline void prefetch_step(const T* pf) {
  constexpr int kBytes = NR * 4;  // one k (float32), k-pair (bfloat16) or k-quad (int8) of NR columns
#pragma GCC unroll 4
  for (int off = 0; off < kBytes; off += 64) __builtin_prefetch(reinterpret_cast<const char*>(pf) + off, 0, 2);
}

// Tile of M <= MR rows of float32 x over kc rows of a float32 panel block; c is [M, NR] (accumulated into unless
// `first`). `pf` (used when PF): the block read after this one.
template <int M, bool PF>
void tile_f32(const float* a, int64_t lda, const float* b, int64_t kc, float* c, bool first, const float* pf) {
  vf acc0[M], acc1[M];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    acc0[r] = first ? vf{} : load(c + r * NR);
    acc1[r] = first ? vf{} : load(c + r * NR + W);
  }
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (PF) prefetch_step(pf + k * NR);
    const vf b0 = load(b + k * NR), b1 = load(b + k * NR + W);
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const vf av = broadcast(a + r * lda + k);
      acc0[r] += av * b0;
      acc1[r] += av * b1;
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    store(c + r * NR, acc0[r]);
    store(c + r * NR + W, acc1[r]);
  }
}

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vu load_u32(const uint16_t* p) {
  vu v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The bfloat16 tile: x's k-pairs (two bfloat16 in one 32-bit word) against the interleaved panel; kc even.
template <int M, bool PF>
void tile_bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kc, float* c, bool first,
               const uint16_t* pf) {
  vf acc0[M], acc1[M];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    acc0[r] = first ? vf{} : load(c + r * NR);
    acc1[r] = first ? vf{} : load(c + r * NR + W);
  }
  for (int64_t k = 0; k < kc; k += 2) {
    if constexpr (PF) prefetch_step(pf + k * NR);
    const vu b0 = load_u32(b + k * NR), b1 = load_u32(b + k * NR + 2 * W);
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const uint32_t pair = load_pair(a + r * lda + k);
#if defined(__AVX512BF16__)
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc0[r] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc0[r]), av, (__m512bh)b0));
      acc1[r] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc1[r]), av, (__m512bh)b1));
#else
      const vf a_even = splat(to_float(static_cast<uint16_t>(pair)));
      const vf a_odd = splat(to_float(static_cast<uint16_t>(pair >> 16)));
      acc0[r] += a_even * reinterpret_cast<vf>(b0 << 16) + a_odd * reinterpret_cast<vf>(b0 & 0xffff0000u);
      acc1[r] += a_even * reinterpret_cast<vf>(b1 << 16) + a_odd * reinterpret_cast<vf>(b1 & 0xffff0000u);
#endif
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    store(c + r * NR, acc0[r]);
    store(c + r * NR + W, acc1[r]);
  }
}

inline vi load_i32(const void* p) {
  vi v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint32_t load_quad(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// Per 32-bit lane: a.lo16 * b.lo16 + a.hi16 * b.hi16, int16 halves (vpmaddwd).
inline vi madd16(vi a, vi b) {
#if defined(__AVX512BW__)
  return reinterpret_cast<vi>(_mm512_madd_epi16(reinterpret_cast<__m512i>(a), reinterpret_cast<__m512i>(b)));
#elif defined(__AVX2__)
  return reinterpret_cast<vi>(_mm256_madd_epi16(reinterpret_cast<__m256i>(a), reinterpret_cast<__m256i>(b)));
#else
  const vi alo = reinterpret_cast<vi>(reinterpret_cast<vu>(a) << 16) >> 16, ahi = a >> 16;
  const vi blo = reinterpret_cast<vi>(reinterpret_cast<vu>(b) << 16) >> 16, bhi = b >> 16;
  return alo * blo + ahi * bhi;
#endif
}

// A lane's four signed bytes (k, k+1, k+2, k+3 of one column) as int16 pairs: {k, k+1} and {k+2, k+3}.
inline void widen_quads(vi b, vi& lo, vi& hi) {
  const vu u = reinterpret_cast<vu>(b);
  const vu byte0 = reinterpret_cast<vu>(reinterpret_cast<vi>(u << 24) >> 24) & 0xffffu;
  const vu byte1 = reinterpret_cast<vu>(reinterpret_cast<vi>(u << 16) >> 8) & 0xffff0000u;
  const vu byte2 = reinterpret_cast<vu>(reinterpret_cast<vi>(u << 8) >> 24) & 0xffffu;
  const vu byte3 = reinterpret_cast<vu>(b >> 8) & 0xffff0000u;
  lo = reinterpret_cast<vi>(byte0 | byte1);
  hi = reinterpret_cast<vi>(byte2 | byte3);
}
#endif

// The int8 tile: x's k-quads (four uint8 in one 32-bit word) against the interleaved int8 panel, into int32; kc a
// multiple of 4.
template <int M, bool PF>
void tile_i8(const uint8_t* a, int64_t lda, const int8_t* b, int64_t kc, int32_t* c, bool first, const int8_t* pf) {
  vi acc0[M], acc1[M];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    acc0[r] = first ? vi{} : load_i32(c + r * NR);
    acc1[r] = first ? vi{} : load_i32(c + r * NR + W);
  }
  for (int64_t k = 0; k < kc; k += 4) {
    if constexpr (PF) prefetch_step(pf + k * NR);
    const vi b0 = load_i32(b + k * NR), b1 = load_i32(b + k * NR + 4 * W);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const __m512i av = _mm512_set1_epi32(static_cast<int>(load_quad(a + r * lda + k)));
      acc0[r] = reinterpret_cast<vi>(
          _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc0[r]), av, reinterpret_cast<__m512i>(b0)));
      acc1[r] = reinterpret_cast<vi>(
          _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc1[r]), av, reinterpret_cast<__m512i>(b1)));
    }
#else
    vi b0lo, b0hi, b1lo, b1hi;
    widen_quads(b0, b0lo, b0hi);
    widen_quads(b1, b1lo, b1hi);
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const uint32_t q = load_quad(a + r * lda + k);  // uint8 bytes: their int16 pairs are the bytes spread out
      const vi xlo = vi{} + static_cast<int32_t>((q & 0xffu) | ((q & 0xff00u) << 8));
      const vi xhi = vi{} + static_cast<int32_t>(((q >> 16) & 0xffu) | ((q >> 24) << 16));
      acc0[r] += madd16(xlo, b0lo) + madd16(xhi, b0hi);
      acc1[r] += madd16(xlo, b1lo) + madd16(xhi, b1hi);
    }
#endif
  }
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    std::memcpy(c + r * NR, &acc0[r], sizeof(vi));
    std::memcpy(c + r * NR + W, &acc1[r], sizeof(vi));
  }
}

// Per x element type: the packed weight's element, the accumulator, the register tile's rows, the k step of one
// panel row (float32 1, bfloat16 pairs 2, int8 quads 4).
template <typename T>
struct Kind {
  using B = T;
  using C = float;
  static constexpr int mr = MR;
  static constexpr int step = 4 / static_cast<int>(sizeof(T));
};
template <>
struct Kind<uint8_t> {
  using B = int8_t;
  using C = int32_t;
  static constexpr int mr = MR8;
  static constexpr int step = 4;
};

template <typename T>
using TileFn = void (*)(const T*, int64_t, const typename Kind<T>::B*, int64_t, typename Kind<T>::C*, bool,
                        const typename Kind<T>::B*);

template <typename T, bool PF, int... Ms>
constexpr auto make_tiles(std::integer_sequence<int, Ms...>) {
  if constexpr (std::is_same_v<T, float>) {
    return std::array<TileFn<T>, sizeof...(Ms)>{&tile_f32<Ms + 1, PF>...};
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    return std::array<TileFn<T>, sizeof...(Ms)>{&tile_bf16<Ms + 1, PF>...};
  } else {
    return std::array<TileFn<T>, sizeof...(Ms)>{&tile_i8<Ms + 1, PF>...};
  }
}

// tiles<T, PF>[m - 1]: the register tile of m rows (PF: prefetching the next block).
template <typename T, bool PF>
constexpr auto tiles = make_tiles<T, PF>(std::make_integer_sequence<int, Kind<T>::mr>{});

// A panel's accumulated [M, NR] rows written to out's valid columns: float32 as is or rounded to bfloat16; int32
// less the columns' offset compensation.
template <typename TO>
void finish(const float* c, int64_t M, int64_t n0, int64_t cols, int64_t N, TO* out, const int32_t*) {
  for (int64_t r = 0; r < M; ++r) {
    const float* src = c + r * NR;
    TO* dst = out + r * N + n0;
    if (cols == NR) {
      store(dst, load(src));
      store(dst + W, load(src + W));
    } else {
      for (int64_t j = 0; j < cols; ++j) from_float(src[j], dst + j);
    }
  }
}

inline void finish(const int32_t* c, int64_t M, int64_t n0, int64_t cols, int64_t N, int32_t* out,
                   const int32_t* comp) {
  for (int64_t r = 0; r < M; ++r) {
    const int32_t* src = c + r * NR;
    int32_t* dst = out + r * N + n0;
    if (cols == NR) {
      const vi d0 = load_i32(src) - load_i32(comp + n0), d1 = load_i32(src + W) - load_i32(comp + n0 + W);
      std::memcpy(dst, &d0, sizeof d0);
      std::memcpy(dst + W, &d1, sizeof d1);
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[j] = src[j] - comp[n0 + j];
    }
  }
}

// One panel: every row of x against packed columns [p * NR, p * NR + NR), written to out's valid columns.
// lda is x's row length; Kp the packed panel's k extent (K rounded up to the kind's k step, with a zero-padded
// x). The first row tile of each K block prefetches the next block, or the first block of `next` (the panel this
// thread runs next; null if unknown). `comp`: the int8 kind's offset compensation (null otherwise).
template <typename T, typename TO>
void run_panel(const T* x, int64_t M, int64_t lda, int64_t Kp, const typename Kind<T>::B* panel, int64_t p, int64_t N,
               TO* out, const typename Kind<T>::B* next, const int32_t* comp) {
  using B = typename Kind<T>::B;
  using C = typename Kind<T>::C;
  constexpr int mr = Kind<T>::mr, step = Kind<T>::step;
  thread_local std::vector<C> c;
  c.resize(static_cast<size_t>(M * NR));
  constexpr int64_t kc_max = kPanelBlockBytes / (NR * static_cast<int64_t>(sizeof(B))) / step * step;
  for (int64_t k0 = 0; k0 < Kp; k0 += kc_max) {
    const int64_t kc = std::min(kc_max, Kp - k0);
    const B* b = panel + k0 * NR;
    const B* pf = k0 + kc < Kp ? b + kc * NR : next;
    for (int64_t r0 = 0; r0 < M; r0 += mr) {
      const int64_t m = std::min<int64_t>(mr, M - r0);
      const auto tile = r0 == 0 && pf != nullptr ? tiles<T, true>[m - 1] : tiles<T, false>[m - 1];
      tile(x + r0 * lda + k0, lda, b, kc, c.data() + r0 * NR, k0 == 0, pf);
    }
  }
  const int64_t n0 = p * NR;
  finish(c.data(), M, n0, std::min<int64_t>(NR, N - n0), N, out, comp);
}

template <typename T, typename TO>
void run(ffi::ThreadPool& pool, const T* x, int64_t M, int64_t K, int64_t Kp, const typename Kind<T>::B* packed,
         int64_t P, int64_t N, TO* out, const int32_t* comp = nullptr) {
  std::vector<T> padded;  // K off the kind's k step: x's rows widened by zeros so that every pair/quad is whole
  int64_t lda = K;
  if (Kp != K) {
    padded.assign(static_cast<size_t>(M * Kp), T{});
    for (int64_t r = 0; r < M; ++r) std::memcpy(padded.data() + r * Kp, x + r * K, K * sizeof(T));
    x = padded.data();
    lda = Kp;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // a long prefill: chunks of rows, each over every panel
    const int64_t rows = std::min(kMaxRows, M - m0);
    const T* xm = x + m0 * lda;
    TO* om = out + m0 * N;
    parallel_for(pool, P, [&](int64_t p, int64_t next) {
      run_panel(xm, rows, lda, Kp, packed + p * Kp * NR, p, N, om, next >= 0 ? packed + next * Kp * NR : nullptr, comp);
    });
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed, int64_t n,
                ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), pd = packed.dimensions(), od = out->dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("packed_gemm: x must be [M, K]");
  const int64_t M = xd[0], K = xd[1];
  const bool bf16 = x.element_type() == ffi::BF16;
  if (!bf16 && x.element_type() != ffi::F32) {
    return ffi::Error::InvalidArgument("packed_gemm: x must be float32 or bfloat16");
  }
  if (packed.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("packed_gemm: x and packed must share one dtype");
  }
  const bool f32_out = out->element_type() == ffi::F32;
  if (!f32_out && out->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("packed_gemm: out must be x's dtype or float32");
  }
  const int64_t Kp = bf16 ? (K + 1) / 2 * 2 : K;
  const int64_t P = (n + NR - 1) / NR;
  const bool shape_ok = bf16 ? (pd.size() == 4 && pd[0] == P && pd[1] == Kp / 2 && pd[2] == NR && pd[3] == 2)
                             : (pd.size() == 3 && pd[0] == P && pd[1] == K && pd[2] == NR);
  if (!shape_ok) {
    return ffi::Error::InvalidArgument(
        "packed_gemm: packed must be [ceil(N/NR), K, NR] (float32) or "
        "[ceil(N/NR), ceil(K/2), NR, 2] (bfloat16) for this library's NR");
  }
  if (od.size() != 2 || od[0] != M || od[1] != n) return ffi::Error::InvalidArgument("packed_gemm: out must be [M, N]");
  if (M == 0 || n == 0) return ffi::Error::Success();
  if (bf16) {
    const auto* xb = static_cast<const uint16_t*>(x.untyped_data());
    const auto* pb = static_cast<const uint16_t*>(packed.untyped_data());
    if (f32_out) {
      run(pool, xb, M, K, Kp, pb, P, n, static_cast<float*>(out->untyped_data()));
    } else {
      run(pool, xb, M, K, Kp, pb, P, n, static_cast<uint16_t*>(out->untyped_data()));
    }
  } else {
    run(pool, static_cast<const float*>(x.untyped_data()), M, K, Kp, static_cast<const float*>(packed.untyped_data()),
        P, n, static_cast<float*>(out->untyped_data()));
  }
  return ffi::Error::Success();
}

ffi::Error ImplInt8(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::AnyBuffer comp, int64_t n,
                    ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), pd = packed.dimensions(), cd = comp.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || x.element_type() != ffi::U8) {
    return ffi::Error::InvalidArgument("packed_gemm_int8: x must be uint8 [M, K] (int8 activations + 128)");
  }
  const int64_t M = xd[0], K = xd[1];
  if (K > kMaxInt8K) return ffi::Error::InvalidArgument("packed_gemm_int8: K must be at most 65536");
  const int64_t Kp = (K + 3) / 4 * 4, P = (n + NR - 1) / NR;
  if (packed.element_type() != ffi::S8 || pd.size() != 4 || pd[0] != P || pd[1] != Kp / 4 || pd[2] != NR ||
      pd[3] != 4) {
    return ffi::Error::InvalidArgument(
        "packed_gemm_int8: packed must be int8 [ceil(N/NR), ceil(K/4), NR, 4] for this library's NR");
  }
  if (comp.element_type() != ffi::S32 || cd.size() != 1 || cd[0] != P * NR) {
    return ffi::Error::InvalidArgument("packed_gemm_int8: comp must be int32 [ceil(N/NR) * NR]");
  }
  if (out->element_type() != ffi::S32 || od.size() != 2 || od[0] != M || od[1] != n) {
    return ffi::Error::InvalidArgument("packed_gemm_int8: out must be int32 [M, N]");
  }
  if (M == 0 || n == 0) return ffi::Error::Success();
  run(pool, static_cast<const uint8_t*>(x.untyped_data()), M, K, Kp, static_cast<const int8_t*>(packed.untyped_data()),
      P, n, static_cast<int32_t*>(out->untyped_data()), static_cast<const int32_t*>(comp.untyped_data()));
  return ffi::Error::Success();
}

// Register-only FMA chains (no memory operands): the path's multiply-add peak on one thread. 2 * MR independent
// accumulators hide the FMA latency as the GEMM's tile does.
template <bool Bf16>
double peak_loop(int64_t iters, float seed) {
  constexpr int kChains = 2 * MR;
  vf acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = splat(seed * static_cast<float>(i));
  vf x = splat(seed), y = splat(1.0f - seed);
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile("" : "+x"(x), "+x"(y));  // x, y are opaque: the chains cannot be folded or hoisted
#pragma GCC unroll 32
    for (int i = 0; i < kChains; ++i) {
#if defined(__AVX512BF16__)
      if constexpr (Bf16) {
        acc[i] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[i]),
                                                       (__m512bh) reinterpret_cast<__m512i>(x),
                                                       (__m512bh) reinterpret_cast<__m512i>(y)));
      } else {
        acc[i] = acc[i] * x + y;
      }
#else
      acc[i] = acc[i] * x + y;
#endif
    }
  }
  float s = 0.0f;
  for (int i = 0; i < kChains; ++i) s += acc[i][0];
  asm volatile("" : : "x"(s));
  const double flops_per_op = (Bf16 && kHasBf16Dot) ? 4.0 : 2.0;  // vdpbf16ps: two products and sums per lane
  return static_cast<double>(iters) * kChains * W * flops_per_op;
}

// The int8 tile's multiply-add peak: 2 * MR8 register-only chains of what tile_i8 runs per k-quad and row
// (vpdpbusd, or two vpmaddwd and their adds), 8 integer operations (4 products, 4 sums) per lane each.
int64_t peak_loop_int8(int64_t iters, int32_t seed) {
  constexpr int kChains = 2 * MR8;
  vi acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = vi{} + seed * i;
  vi x = vi{} + seed, y = vi{} + (seed ^ 0x5a5a5a5a);
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile("" : "+x"(x), "+x"(y));
#pragma GCC unroll 32
    for (int i = 0; i < kChains; ++i) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      acc[i] = reinterpret_cast<vi>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc[i]), reinterpret_cast<__m512i>(x),
                                                        reinterpret_cast<__m512i>(y)));
#else  // each chain's products read its accumulator, so they cannot be shared across chains; unsigned sums wrap
      acc[i] = reinterpret_cast<vi>(reinterpret_cast<vu>(acc[i]) + reinterpret_cast<vu>(madd16(acc[i], x)) +
                                    reinterpret_cast<vu>(madd16(acc[i], y)));
#endif
    }
  }
  int32_t s = 0;
  for (int i = 0; i < kChains; ++i) s ^= acc[i][0];
  asm volatile("" : : "r"(s));
  return iters * kChains * W * 8;
}

// Sums n floats (n a multiple of 4 * W) with vector loads and four independent sums: a sequential read stream,
// the memory side of the GEMM's roofline (a weight that does not fit the caches is read like this once per call).
float read_loop(const float* p, int64_t n) {
  vf s0{}, s1{}, s2{}, s3{};
  for (int64_t i = 0; i < n; i += 4 * W) {
    s0 += load(p + i);
    s1 += load(p + i + W);
    s2 += load(p + i + 2 * W);
    s3 += load(p + i + 3 * W);
  }
  const vf s = s0 + s1 + s2 + s3;
  float total = 0.0f;
  for (int i = 0; i < W; ++i) total += s[i];
  return total;
}

}  // namespace
}  // namespace pja

// Columns per packed panel of this library (2 vectors of its ISA).
extern "C" int64_t PackedGemmPanelWidth() { return pja::NR; }

// The instruction-set path this library was built for ("avx512+bf16", "avx512", "avx2" or "generic").
extern "C" const char* PackedGemmIsa() { return pja::kHasBf16Dot ? "avx512+bf16" : pja::kIsa; }

// 1 where the int8 product multiplies with AVX-512 VNNI (vpdpbusd), 0 where it widens to int16 pairs.
extern "C" int32_t PackedGemmHasVnni() { return pja::kVnni ? 1 : 0; }

// Runs `iters` rounds of the register-only FMA loop on the calling thread (bf16 != 0: the vdpbf16ps loop where
// the path has it, else the float32 one) and returns the floating-point operations it did.
extern "C" double PackedGemmPeakLoop(int64_t iters, int32_t bf16) {
  return bf16 ? pja::peak_loop<true>(iters, 0.5f) : pja::peak_loop<false>(iters, 0.5f);
}

// The same for the int8 product's multiply-adds (vpdpbusd where the path has VNNI): the integer operations done.
extern "C" double PackedGemmPeakLoopInt8(int64_t iters) { return static_cast<double>(pja::peak_loop_int8(iters, 3)); }

// Reads n floats at p once, sequentially, on the calling thread (n a multiple of 2 * PackedGemmPanelWidth()) and
// returns their sum (so the reads cannot be dropped).
extern "C" float PackedGemmReadLoop(const float* p, int64_t n) { return pja::read_loop(p, n); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedGemm, pja::Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // packed weight
                                  .Attr<int64_t>("n")     // N, the weight's columns
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedGemmInt8, pja::ImplInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] uint8 (int8 + 128)
                                  .Arg<ffi::AnyBuffer>()  // packed int8 weight
                                  .Arg<ffi::AnyBuffer>()  // comp [P * NR] int32
                                  .Attr<int64_t>("n")     // N, the weight's columns
                                  .Ret<ffi::AnyBuffer>());
