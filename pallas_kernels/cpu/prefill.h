// Prefill work items (a block of query tokens x the `group` query heads of one KV head) as blocked matrix
// products.
//
// The item's R = tokens x group query rows are held transposed, Qt [D, Rp] (rows padded to a whole vector), so
// that every step vectorizes along the rows. Per block of kPrefillBlock key positions:
//   convert  the block's K and V rows are widened to float32 once (Kf, Vf [keys, D]; absent keys are zeros);
//   scores   St [keys, Rp] = Kf . Qt, register tiles of kTileKeys keys x 2 row vectors over head_dim;
//   softmax  scale, soft cap and mask (causal, window) per key row, the online-softmax step per row vector;
//   values   Ot [D, Rp] = alpha * Ot + Vf^T . P, register tiles of kTileDims dims x 2 row vectors over the keys.
// The output is transposed back once per item.

#pragma once

#include "problem.h"

namespace pja {

constexpr int64_t kPrefillBlock = 64;  // key positions per block (a multiple of kTileKeys)
constexpr int kTileKeys = W == 16 ? 8 : 4;
constexpr int kTileDims = W == 16 ? 8 : 4;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// St[j0 + j, r0 : r0 + NRV * W] = sum_d Kf[j0 + j, d] * Qt[d, r0 : ...] for j < NJ.
template <int NJ, int NRV>
inline void score_tile(const float* Kf, int64_t D, const float* Qt, int64_t Rp, float* St, int64_t j0, int64_t r0) {
  vf acc[NJ][NRV];
  for (int j = 0; j < NJ; ++j)
    for (int v = 0; v < NRV; ++v) acc[j][v] = vf{};
  for (int64_t d = 0; d < D; ++d) {
    vf qv[NRV];
    for (int v = 0; v < NRV; ++v) qv[v] = load(Qt + d * Rp + r0 + v * W);
    for (int j = 0; j < NJ; ++j) {
      const vf kb = splat(Kf[(j0 + j) * D + d]);
      for (int v = 0; v < NRV; ++v) acc[j][v] += kb * qv[v];
    }
  }
  for (int j = 0; j < NJ; ++j)
    for (int v = 0; v < NRV; ++v) store(St + (j0 + j) * Rp + r0 + v * W, acc[j][v]);
}

// Ot[d0 + d, r0 : r0 + NRV * W] = alpha[r0 : ...] * Ot[...] + sum_j Vf[j, d0 + d] * P[j, r0 : ...] for d < ND.
template <int ND, int NRV>
inline void value_tile_t(const float* Vf, int64_t Dp, const float* P, int64_t Rp, int64_t n, const float* alpha,
                         float* Ot, int64_t d0, int64_t r0) {
  vf acc[ND][NRV];
  for (int v = 0; v < NRV; ++v) {
    const vf a = load(alpha + r0 + v * W);
    for (int d = 0; d < ND; ++d) acc[d][v] = load(Ot + (d0 + d) * Rp + r0 + v * W) * a;
  }
  for (int64_t j = 0; j < n; ++j) {
    vf pv[NRV];
    for (int v = 0; v < NRV; ++v) pv[v] = load(P + j * Rp + r0 + v * W);
    for (int d = 0; d < ND; ++d) {
      const vf vb = splat(Vf[j * Dp + d0 + d]);
      for (int v = 0; v < NRV; ++v) acc[d][v] += vb * pv[v];
    }
  }
  for (int d = 0; d < ND; ++d)
    for (int v = 0; v < NRV; ++v) store(Ot + (d0 + d) * Rp + r0 + v * W, acc[d][v]);
}

// Floats of scratch a prefill item of R rows needs.
inline int64_t prefill_scratch(int64_t R, int64_t D) {
  const int64_t Rp = round_up(R, W), Dp = round_up(D, kTileDims), B = kPrefillBlock;
  return D * Rp + Dp * Rp + B * Rp + B * D + B * Dp + 4 * Rp + 3 * B;
}

// Folds the keys [lo, hi] into the state of the item's R rows (q [R, D] float32, row r at position
// pos0 + r / group); the state's acc is [R, D] row-major.
template <typename T>
void prefill_item(const Problem& p, const KvRows<T>& kv, const float* q, int64_t R, int64_t pos0, int64_t lo,
                  int64_t hi, const RowState& st, float* scratch, int32_t* rowpos) {
  const int64_t G = p.group, D = p.head_dim, B = kPrefillBlock;
  const int64_t Rp = round_up(R, W), Dp = round_up(D, kTileDims);
  float* Qt = scratch;
  float* Ot = Qt + D * Rp;
  float* St = Ot + Dp * Rp;
  float* Kf = St + B * Rp;
  float* Vf = Kf + B * D;
  float* m = Vf + B * Dp;
  float* l = m + Rp;
  float* alpha = l + Rp;
  float* mx = alpha + Rp;
  float* kscale = mx + Rp;
  float* vscale = kscale + B;
  float* valid = vscale + B;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = 0; r < Rp; ++r) Qt[d * Rp + r] = r < R ? q[r * D + d] : 0.0f;
  std::fill(Ot, Ot + Dp * Rp, 0.0f);
  std::fill(m, m + Rp, -INFINITY);
  std::fill(l, l + Rp, 0.0f);
  for (int64_t r = 0; r < Rp; ++r) rowpos[r] = r < R ? static_cast<int32_t>(pos0 + r / G) : -1;
  const vf neg_inf = splat(-INFINITY);

  for (int64_t b_lo = lo; b_lo <= hi;) {
    const int64_t b_hi = std::min(hi + 1, (b_lo / B + 1) * B);
    const int64_t n = b_hi - b_lo, nj = round_up(n, kTileKeys);
    kv.prefetch(b_hi, std::min(hi + 1, b_hi + B));
    // Convert the block's K and V rows once; absent keys (and the tile's padding) are zero rows.
    for (int64_t pos = b_lo; pos < b_lo + nj;) {
      const int64_t stop = pos < b_hi ? kv.run_end(pos, b_hi) : b_lo + nj;
      const int64_t pg = pos < b_hi ? kv.page(pos) : -1;
      for (; pos < stop; ++pos) {
        const int64_t j = pos - b_lo;
        float* kf = Kf + j * D;
        float* vfr = Vf + j * Dp;
        valid[j] = pg >= 0 ? 1.0f : 0.0f;
        if (pg < 0) {
          std::fill(kf, kf + D, 0.0f);
          std::fill(vfr, vfr + Dp, 0.0f);
          kscale[j] = vscale[j] = 0.0f;
          continue;
        }
        const T* row = kv.row(pg, pos);
        int64_t d = 0;
        for (; d + W <= D; d += W) {
          store(kf + d, load(row + d));
          store(vfr + d, load(row + D + d));
        }
        for (; d < D; ++d) {
          kf[d] = to_float(row[d]);
          vfr[d] = to_float(row[D + d]);
        }
        for (; d < Dp; ++d) vfr[d] = 0.0f;
        kscale[j] = p.sm_scale * kv.scale(pg, pos, 0);
        vscale[j] = kv.scale(pg, pos, 1);
      }
    }
    // Scores.
    for (int64_t j0 = 0; j0 < nj; j0 += kTileKeys) {
      int64_t r0 = 0;
      for (; r0 + 2 * W <= Rp; r0 += 2 * W) score_tile<kTileKeys, 2>(Kf, D, Qt, Rp, St, j0, r0);
      if (r0 < Rp) score_tile<kTileKeys, 1>(Kf, D, Qt, Rp, St, j0, r0);
    }
    // Scale, soft cap, mask; the block's max per row.
    std::fill(mx, mx + Rp, -INFINITY);
    for (int64_t j = 0; j < nj; ++j) {
      const int32_t kp = static_cast<int32_t>(b_lo + j);
      const bool present = valid[j] != 0.0f;
      for (int64_t r0 = 0; r0 < Rp; r0 += W) {
        vf x = load(St + j * Rp + r0) * kscale[j];
        if (p.soft_cap > 0.0f) x = soft_cap(x, p.soft_cap);
        vi rp;
        std::memcpy(&rp, rowpos + r0, sizeof rp);
        vi vis = (rp >= kp) & (present ? -1 : 0);
        if (p.window > 0) vis &= (rp - static_cast<int32_t>(p.window)) < kp;
        x = vis ? x : neg_inf;
        store(St + j * Rp + r0, x);
        const vf cur = load(mx + r0);
        store(mx + r0, (x > cur) ? x : cur);
      }
    }
    // The online-softmax step; P (times the V scales) replaces the scores.
    for (int64_t r0 = 0; r0 < Rp; r0 += W) {
      const vf m_old = load(m + r0), bm = load(mx + r0);
      const vf m_new = (bm > m_old) ? bm : m_old;
      const vf a = (m_new == -INFINITY) ? splat(1.0f) : exp_nonpositive(m_old - m_new);
      vf sum = vf{};
      for (int64_t j = 0; j < nj; ++j) {
        const vf x = load(St + j * Rp + r0);
        const vf e = (x == -INFINITY) ? vf{} : exp_nonpositive(x - m_new);
        sum += e;
        store(St + j * Rp + r0, e * vscale[j]);
      }
      store(l + r0, load(l + r0) * a + sum);
      store(m + r0, m_new);
      store(alpha + r0, a);
    }
    // Values.
    for (int64_t d0 = 0; d0 < Dp; d0 += kTileDims) {
      int64_t r0 = 0;
      for (; r0 + 2 * W <= Rp; r0 += 2 * W) value_tile_t<kTileDims, 2>(Vf, Dp, St, Rp, nj, alpha, Ot, d0, r0);
      if (r0 < Rp) value_tile_t<kTileDims, 1>(Vf, Dp, St, Rp, nj, alpha, Ot, d0, r0);
    }
    b_lo = b_hi;
  }
  for (int64_t r = 0; r < R; ++r) {
    st.m[r] = m[r];
    st.l[r] = l[r];
    for (int64_t d = 0; d < D; ++d) st.acc[r * D + d] = Ot[d * Rp + r];
  }
}

}  // namespace pja
