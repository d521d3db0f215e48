// Decode work items (one query token, the `group` query heads of one KV head) as register tiles.
//
// Memory-bound: every K/V byte is used `group` times. The keys are walked in blocks of kDecodeBlock positions:
//   scores  a tile of kDecodeHeads query heads x 4 keys accumulates in registers over head_dim (K rows read in
//           place from their pages; bfloat16 pages use vdpbf16ps where the CPU has it), the four dots of a
//           head finished together (hsum4);
//   softmax one online-softmax step per block and head, vectorized over the block's keys;
//   values  a tile of kDecodeHeads heads x kDecodeChunk vectors of head_dim accumulates p * V over the block's
//           keys in registers, loaded and stored once per block.
// The rows of the next block are prefetched into L1 a few keys at a time while a block's scores are computed.

#pragma once

#include <type_traits>

#include "problem.h"

namespace pja {

constexpr int64_t kDecodeBlock = 32;  // key positions per online-softmax step (a multiple of W and of 32)
constexpr int kDecodeHeads = W == 16 ? 4 : 2;
constexpr int kDecodeChunk = 4;  // vectors of head_dim per value tile
// Blocks prefetched ahead, into L1 (prefetcht0): a decode step's pages come from memory (the forward's weights
// pass between two reads of a layer's pages), and two blocks into L2 made each item start with a burst of two
// blocks' lines (docs/benchmarks/kernels.md: the figures).
constexpr int kPrefetchBlocks = 1;
constexpr int kPrefetchLocality = 3;

// dots[g * stride + i] = q[g] . k_i for g < NG and the 4 key rows k_i (q rows [NG, D] float32; qb the same rows
// in bfloat16 when T is bfloat16).
#if defined(__AVX512BF16__)
// bfloat16 pages on AVX-512 BF16: 32 bfloat16 pairs per vdpbf16ps, K never widened. (The tail loops come after
// the tiles are stored: a tail that reads the tiles made GCC keep them in memory, 16 stores per iteration.)
template <int NG>
inline void dot_tile_bf16(const float* q, const uint16_t* qb, int64_t D, const uint16_t* const* k, float* dots,
                          int64_t stride) {
  __m512 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m512bh kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[i] + d));
    for (int g = 0; g < NG; ++g) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qb + g * D + d));
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], qv, kv[i]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    hsum4(reinterpret_cast<vf>(acc[g][0]), reinterpret_cast<vf>(acc[g][1]), reinterpret_cast<vf>(acc[g][2]),
          reinterpret_cast<vf>(acc[g][3]), dots + g * stride);
  }
  for (int64_t t = d; t < D; ++t)  // head_dim not a multiple of 32
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) dots[g * stride + i] += q[g * D + t] * to_float(k[i][t]);
}
#endif

// dots[g * stride + i] = q[g] . k_i for g < NG and the 4 key rows k_i (q rows [NG, D] float32; qb the same rows
// in bfloat16 when T is bfloat16).
template <int NG, typename T>
inline void dot_tile(const float* q, const uint16_t* qb, int64_t D, const T* const* k, float* dots, int64_t stride) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    dot_tile_bf16<NG>(q, qb, D, k, dots, stride);
    return;
  }
#endif
  (void)qb;
  vf acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = vf{};
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    vf kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = load(k[i] + d);
    for (int g = 0; g < NG; ++g) {
      const vf qv = load(q + g * D + d);
      for (int i = 0; i < 4; ++i) acc[g][i] += qv * kv[i];
    }
  }
  for (int g = 0; g < NG; ++g) hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], dots + g * stride);
  for (int64_t t = d; t < D; ++t)  // head_dim not a multiple of W (a separate loop: the tiles stay in registers)
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) dots[g * stride + i] += q[g * D + t] * to_float(k[i][t]);
}

// acc[g, d0 : d0 + DC * W] = alpha[g] * acc[g, ...] + sum_i p[g * stride + i] * v_i[d0 : ...] for g < NG.
template <int NG, int DC, typename T>
inline void value_tile(const float* p, int64_t stride, const T* const* v, int64_t n, const float* alpha, float* acc,
                       int64_t D, int64_t d0) {
  vf a[NG][DC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = load(acc + g * D + d0 + c * W) * alpha[g];
  for (int64_t i = 0; i < n; ++i) {
    vf vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = load(v[i] + d0 + c * W);
    for (int g = 0; g < NG; ++g) {
      const vf pb = splat(p[g * stride + i]);
      for (int c = 0; c < DC; ++c) a[g][c] += pb * vv[c];
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c) store(acc + g * D + d0 + c * W, a[g][c]);
}

template <int NG, typename T>
void value_heads(const float* p, int64_t stride, const T* const* v, int64_t n, const float* alpha, float* acc,
                 int64_t D) {
  int64_t d0 = 0;
  for (; d0 + kDecodeChunk * W <= D; d0 += kDecodeChunk * W)
    value_tile<NG, kDecodeChunk>(p, stride, v, n, alpha, acc, D, d0);
  for (; d0 + W <= D; d0 += W) value_tile<NG, 1>(p, stride, v, n, alpha, acc, D, d0);
  for (; d0 < D; ++d0) {  // head_dim not a multiple of W
    for (int g = 0; g < NG; ++g) {
      float s = acc[g * D + d0] * alpha[g];
      for (int64_t i = 0; i < n; ++i) s += p[g * stride + i] * to_float(v[i][d0]);
      acc[g * D + d0] = s;
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 pages on AVX-512 BF16: p . V by vdpbf16ps, two keys per instruction. The V rows of keys i and i + 1 are
// interleaved (unpacklo/hi of 16-bit elements), so each accumulator pair holds head_dim in the permuted order
// `bf16_dim` names; pp[g * stride + i / 2] = the bfloat16 pair (p[g, i], p[g, i + 1]). acc is in that order
// throughout the item (unpermute_bf16 restores it at the end).
constexpr bool kBf16Values = true;

template <int NG, int DC>
inline void value_tile_bf16(const uint32_t* pp, int64_t stride, const uint16_t* const* v, int64_t n, const float* alpha,
                            float* acc, int64_t D, int64_t d0) {
  __m512 a[NG][DC][2];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c)
      for (int h = 0; h < 2; ++h) {
        a[g][c][h] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + d0 + c * 32 + h * 16), _mm512_set1_ps(alpha[g]));
      }
  for (int64_t i = 0; i < n; i += 2) {
    const uint16_t* v0 = v[i];
    const uint16_t* v1 = v[std::min<int64_t>(i + 1, n - 1)];  // an odd last key pairs with itself, weight 0
    __m512bh vv[DC][2];
    for (int c = 0; c < DC; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + d0 + c * 32), y = _mm512_loadu_si512(v1 + d0 + c * 32);
      vv[c][0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x, y));
      vv[c][1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x, y));
    }
    for (int g = 0; g < NG; ++g) {
      const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[g * stride + i / 2])));
      for (int c = 0; c < DC; ++c)
        for (int h = 0; h < 2; ++h) a[g][c][h] = _mm512_dpbf16_ps(a[g][c][h], pb, vv[c][h]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < DC; ++c)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc + g * D + d0 + c * 32 + h * 16, a[g][c][h]);
}

template <int NG>
void value_heads_bf16(const uint32_t* pp, int64_t stride, const uint16_t* const* v, int64_t n, const float* alpha,
                      float* acc, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) value_tile_bf16<NG, 2>(pp, stride, v, n, alpha, acc, D, d0);
  for (; d0 < D; d0 += 32) value_tile_bf16<NG, 1>(pp, stride, v, n, alpha, acc, D, d0);
}

// Position in a 32-dim chunk of accumulator slot s (0..31): slot s = 16 h + 4 lane + k holds dim 8 lane + 4 h + k.
inline int64_t bf16_dim(int64_t s) { return 8 * ((s % 16) / 4) + 4 * (s / 16) + s % 4; }

inline void unpermute_bf16(float* acc, int64_t rows, int64_t D) {
  // Slots 0..15 (h = 0) hold the dims 8 j + [0, 4), slots 16..31 the dims 8 j + [4, 8), j = 0..3: two 2-source
  // permutes per 32 dims.
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      float* a = acc + r * D + d0;
      const __m512 x = _mm512_loadu_ps(a), y = _mm512_loadu_ps(a + 16);
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(x, lo, y));
      _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(x, hi, y));
    }
}
#else
constexpr bool kBf16Values = false;
#endif

// Runs `fn.template operator()<NG>(g0)` over the heads [0, G) in tiles of kDecodeHeads (the last one smaller).
template <typename Fn>
inline void for_head_tiles(int64_t G, const Fn& fn) {
  int64_t g0 = 0;
  for (; g0 + kDecodeHeads <= G; g0 += kDecodeHeads) fn.template operator()<kDecodeHeads>(g0);
  switch (G - g0) {
    case 1:
      fn.template operator()<1>(g0);
      break;
    case 2:
      if constexpr (kDecodeHeads > 2) fn.template operator()<2>(g0);
      break;
    case 3:
      if constexpr (kDecodeHeads > 3) fn.template operator()<3>(g0);
      break;
    default:
      break;
  }
}

// Folds the keys [lo, hi] of one sequence and KV head into the state of the item's G rows.
// q [G, D] float32 (qb: the same in bfloat16 for bfloat16 pages); sc: scratch of decode_scratch(G) floats.
inline int64_t decode_scratch(int64_t G) { return G * kDecodeBlock + G + G * kDecodeBlock / 2; }

// next (optional): the rows of the item the thread runs next, whose keys [next_lo, next_hi] start being
// prefetched while this item's last block is computed.
template <typename T>
void decode_item(const Problem& p, const KvRows<T>& kv, const float* q, const uint16_t* qb, int64_t lo, int64_t hi,
                 const RowState& st, float* sc, const KvRows<T>* next = nullptr, int64_t next_lo = 0,
                 int64_t next_hi = -1) {
  const int64_t G = p.group, D = p.head_dim, B = kDecodeBlock;
  const T* krow[kDecodeBlock];
  const T* vrow[kDecodeBlock];
  alignas(64) float kscale[kDecodeBlock];
  alignas(64) float vscale[kDecodeBlock];
  float* alpha = sc + G * B;
  // bfloat16 pages with AVX-512 BF16: p . V by vdpbf16ps (p rounded to bfloat16, as the XLA path does).
  [[maybe_unused]] const bool bf16_values = kBf16Values && std::is_same_v<T, uint16_t> && D % 32 == 0;
  [[maybe_unused]] uint32_t* pairs = reinterpret_cast<uint32_t*>(alpha + G);
  // The K|V rows of the block kPrefetchBlocks ahead: prefetched a few keys at a time while this block's scores
  // are computed (a burst of a whole block's prefetches would stall the core on the fill buffers, with nothing
  // computed meanwhile).
  const T* ahead_rows[kDecodeBlock];
  const int64_t row_bytes = kv.row_bytes();
  const int64_t first = lo / B * B;
  for (int64_t b = 0; b < kPrefetchBlocks; ++b)
    kv.template prefetch<kPrefetchLocality>(std::max(lo, first + b * B), std::min(hi + 1, first + (b + 1) * B));
  for (int64_t b_lo = lo; b_lo <= hi;) {
    const int64_t b_hi = std::min(hi + 1, (b_lo / B + 1) * B);
    const int64_t ahead = (b_lo / B + kPrefetchBlocks) * B;
    int64_t n_ahead = 0;
    if (ahead <= hi) {
      n_ahead = kv.rows(ahead, std::min(hi + 1, ahead + B), ahead_rows);
    } else if (next != nullptr && b_hi > hi && next_lo <= next_hi) {  // this item's last block
      n_ahead = next->rows(next_lo, std::min(next_hi + 1, (next_lo / B + 1) * B), ahead_rows);
    }
    // The block's keys whose page exists, compacted.
    // One page lookup per run of keys in a page; the run's rows and scales are then consecutive.
    int64_t n = 0;
    for (int64_t pos = b_lo; pos < b_hi;) {
      const int64_t stop = kv.run_end(pos, b_hi);
      const int64_t pg = kv.page(pos);
      if (pg >= 0) {
        const T* row = kv.row(pg, pos);
        const float* ks = kv.scales_of(pg, pos, 0);
        const float* vs = kv.scales_of(pg, pos, 1);
        for (int64_t j = 0; j < stop - pos; ++j, ++n) {
          krow[n] = row + j * 2 * D;
          vrow[n] = krow[n] + D;
          kscale[n] = ks ? p.sm_scale * ks[j] : p.sm_scale;
          vscale[n] = vs ? vs[j] : 1.0f;
        }
      }
      pos = stop;
    }
    if (n == 0) {
      b_lo = b_hi;
      continue;
    }
    for (int64_t i = n; i < B; ++i) kscale[i] = vscale[i] = 0.0f;
    // Scores: tiles of heads x 4 keys (a short last tile repeats its last key; the extra dots are masked).
    int64_t fetched = 0;
    for (int64_t j = 0; j < n; j += 4) {
      for (const int64_t stop = std::min(n_ahead, fetched + 4); fetched < stop; ++fetched) {
        KvRows<T>::template prefetch_bytes<kPrefetchLocality>(ahead_rows[fetched], row_bytes);
      }
      const T* k4[4];
      for (int i = 0; i < 4; ++i) k4[i] = krow[std::min<int64_t>(j + i, n - 1)];
      for_head_tiles(G, [&]<int NG>(int64_t g0) { dot_tile<NG>(q + g0 * D, qb + g0 * D, D, k4, sc + g0 * B + j, B); });
    }
    for (; fetched < n_ahead; ++fetched)
      KvRows<T>::template prefetch_bytes<kPrefetchLocality>(ahead_rows[fetched], row_bytes);
    // One online-softmax step per head; the vector lanes are the block's keys, keys >= n are masked.
    for (int64_t g = 0; g < G; ++g) {
      float* s = sc + g * B;
      vf mx = splat(-INFINITY);
      for (int64_t i = 0; i < B; i += W) {
        vf x = load(s + i) * load(kscale + i);
        if (p.soft_cap > 0.0f) x = soft_cap(x, p.soft_cap);
        vi lane;
        for (int w = 0; w < W; ++w) lane[w] = static_cast<int32_t>(i + w);
        x = (lane < static_cast<int32_t>(n)) ? x : splat(-INFINITY);
        store(s + i, x);
        mx = (x > mx) ? x : mx;
      }
      const float m_old = st.m[g];
      const float m_new = std::max(m_old, hmax(mx));
      alpha[g] = exp_nonpositive(m_old - m_new);  // 0 on the first block (m_old = -inf)
      vf sum = vf{};
      for (int64_t i = 0; i < B; i += W) {
        const vf e = exp_nonpositive(load(s + i) - m_new);
        sum += e;
        store(s + i, e * load(vscale + i));
      }
      st.l[g] = st.l[g] * alpha[g] + hsum(sum);
      st.m[g] = m_new;
    }
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (bf16_values) {
        // p rounded to bfloat16 (nearest even) 32 at a time, in key order: the pairs (p[i], p[i + 1]) are then
        // consecutive 32-bit words. The block's keys >= n have p = 0 (masked above), so an odd last key's partner
        // weighs 0.
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t i = 0; i < B; i += 32) {
            const __m512bh r =
                _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sc + g * B + i + 16), _mm512_loadu_ps(sc + g * B + i));
            _mm512_storeu_si512(pairs + g * (B / 2) + i / 2, reinterpret_cast<__m512i>(r));
          }
        }
        for_head_tiles(G, [&]<int NG>(int64_t g0) {
          value_heads_bf16<NG>(pairs + g0 * (B / 2), B / 2, vrow, n, alpha + g0, st.acc + g0 * D, D);
        });
        b_lo = b_hi;
        continue;
      }
    }
#endif
    for_head_tiles(
        G, [&]<int NG>(int64_t g0) { value_heads<NG>(sc + g0 * B, B, vrow, n, alpha + g0, st.acc + g0 * D, D); });
    b_lo = b_hi;
  }
#if defined(__AVX512BF16__)
  if (bf16_values) unpermute_bf16(st.acc, G, D);
#endif
}

}  // namespace pja
