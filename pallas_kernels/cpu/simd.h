// Vector arithmetic for the CPU paged-attention kernel, one instruction-set path per build.
//
// The path is chosen at build time by the compiler's target flags (pallas_kernels/cpu_paged.py builds one library
// per path and keys the kernel cache on the flags and the CPU): AVX-512F (16 float lanes, 32 registers),
// AVX2 + FMA (8 lanes, 16 registers), or generic (4 lanes of GCC/Clang vector extensions, any CPU). AVX-512 BF16
// adds `vdpbf16ps` for the q . k dots of bfloat16 pages (see kHasBf16Dot). Everything else is written once on
// GCC vector extensions (`a * b + c` is one FMA: the library is built with -ffp-contract=fast), with intrinsics
// only where the extensions have no good spelling (horizontal sums).
//
// Stored element types: float, bfloat16 (uint16_t bits), int8 and float8_e4m3fn (Fp8 bits); load<T>() widens
// W consecutive elements to float32 exactly.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
// GCC before 12.3 reports its own _mm512_undefined_* (`__m512i __Y = __Y;`) as -Wmaybe-uninitialized once
// inlined into our loops (GCC bug 105593); the false positive is silenced for the intrinsics header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace pja {

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr const char* kIsa = "avx2";
#else
constexpr int W = 4;
constexpr const char* kIsa = "generic";
#endif
#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif
// Vector registers of the path (accumulator tiles are sized so that they, their operands and a broadcast fit).
constexpr int kRegisters = W == 16 ? 32 : 16;

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

struct Fp8 {  // float8_e4m3fn bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN = S.1111.111
  uint8_t bits;
};

inline vf splat(float x) { return vf{} + x; }

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(Fp8 x) {
  const int mag = x.bits & 0x7f, exp = mag >> 3, man = mag & 7;
  float f = mag == 0x7f ? NAN
            : exp == 0  ? std::ldexp(static_cast<float>(man), -9)
                        : std::ldexp(static_cast<float>(8 + man), exp - 10);
  return (x.bits & 0x80) ? -f : f;
}

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, as XLA's convert; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

// W consecutive elements widened to float32.
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// Widening loads: one vpmovzx/vpmovsx each on x86 (GCC's generic spelling of these scalarizes or splits them).
inline vu widen_u16(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vu>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vu>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vu u;
  for (int i = 0; i < W; ++i) u[i] = p[i];
  return u;
#endif
}
inline vi widen_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vi>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vi u;
  for (int i = 0; i < W; ++i) u[i] = p[i];
  return u;
#endif
}
inline vu widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vu>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vu>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vu u;
  for (int i = 0; i < W; ++i) u[i] = p[i];
  return u;
#endif
}

inline vf load(const uint16_t* p) { return reinterpret_cast<vf>(widen_u16(p) << 16); }
inline vf load(const int8_t* p) { return __builtin_convertvector(widen_i8(p), vf); }
inline vf load(const Fp8* p) {
  const vu x = widen_u8(&p->bits);
  const vu mag = x & 0x7fu;
  // Normal numbers: exponent and mantissa moved into float32's fields, then rebiased (2^(127 - 7)): exact.
  const vf normal = reinterpret_cast<vf>(mag << 20) * 0x1p120f;
  // Subnormals (exponent 0): mantissa * 2^-9, not through a float32 subnormal (the thread may flush those).
  const vf sub = __builtin_convertvector(reinterpret_cast<vi>(mag & 7u), vf) * 0x1p-9f;
  vf f = (mag < 8u) ? sub : normal;
  f = (mag == 0x7fu) ? splat(NAN) : f;
  return reinterpret_cast<vf>(reinterpret_cast<vu>(f) | ((x & 0x80u) << 24));
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// W floats stored as the element type: float as is, bfloat16 as from_float rounds each (nearest even, NaN stays
// NaN), lane by lane the same bits.
inline void store(uint16_t* p, vf v) {
  const vu bits = reinterpret_cast<vu>(v);
  const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu r = ((bits & 0x7fffffffu) > 0x7f800000u) ? ((bits >> 16) | 0x40u) : rounded;
  const vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof h);
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
#endif
}

// out[0..3] = horizontal sums of a, b, c, d (four dot products finished at once: the shuffles are shared).
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
#if defined(__AVX512F__)
  const __m512 A = reinterpret_cast<__m512>(a), B = reinterpret_cast<__m512>(b);
  const __m512 C = reinterpret_cast<__m512>(c), D = reinterpret_cast<__m512>(d);
  // [a.lo256 + a.hi256 | b.lo256 + b.hi256], the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, 0x44), _mm512_shuffle_f32x4(C, D, 0xee));
  // one 128-bit lane each of a, b, c, d
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  // sum the 4 floats of each 128-bit lane
  const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4e));
  const __m512 z = _mm512_add_ps(y, _mm512_permute_ps(y, 0xb1));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, z)));
#elif defined(__AVX2__)
  const __m256 ab = _mm256_hadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b));
  const __m256 cd = _mm256_hadd_ps(reinterpret_cast<__m256>(c), reinterpret_cast<__m256>(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  out[0] = hsum(a);
  out[1] = hsum(b);
  out[2] = hsum(c);
  out[3] = hsum(d);
#endif
}

// exp(x) for x <= 0, to about 2 ulp, branch-free. x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial, 2^n by the exponent bits. Defined edges: x < -87 (the exact value is below float32's
// normal range) and -inf give exactly 0; NaN gives NaN (a NaN score makes its row NaN).
inline vf exp_nonpositive(vf x) {
  const vi in_range = x >= -87.0f;  // false for NaN and -inf
  const vf xc = in_range ? x : splat(-87.0f);
  const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer (|v| < 2^22)
  const vf n = (xc * 1.44269504088896341f + round) - round;
  // r = x - n ln2 in two steps (Cody-Waite): n * 0.693145751953125 is exact (the constant has 12 significant
  // bits, |n| <= 126) and so is its difference with x; the small rest of ln2 comes off after.
  vf r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  vf y = splat(1.0f / 720.0f);
  y = y * r + 1.0f / 120.0f;
  y = y * r + 1.0f / 24.0f;
  y = y * r + 1.0f / 6.0f;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  const vf scale = reinterpret_cast<vf>((__builtin_convertvector(n, vi) + 127) << 23);
  const vf e = in_range ? y * scale : vf{};
  return (x != x) ? x : e;
}

inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// soft_cap * tanh(x / soft_cap), from exp_nonpositive: tanh|u| = (1 - e) / (1 + e) with e = exp(-2|u|)
// (absolute error about 1e-7 of soft_cap); NaN stays NaN.
inline vf soft_cap(vf x, float cap) {
  const vf u = x * (1.0f / cap);
  const vf a = (u < 0.0f) ? -u : u;
  const vf e = exp_nonpositive(-2.0f * a);
  const vf t = (1.0f - e) / (1.0f + e);
  return cap * ((u < 0.0f) ? -t : t);
}

}  // namespace pja
