// Ragged paged attention for XLA:CPU as an XLA FFI custom call: every page is read once, in place.
//
// Why a C++ kernel: on CPU the XLA formulation (pallas_kernels/xla_paged.py) must gather pages into a
// contiguous buffer before each batched dot (XLA cannot fuse a gather into a dot), and the dots over tiny
// per-(sequence, KV head) matrices then re-read that copy twice; a decode step of a small model spends 40-50%
// of its time there. Here each work item (one sequence, one KV head, a block of its query tokens) walks its
// pages through the block table and folds each page's K and V into an online softmax while the page is in L1.
//
// Semantics are those of pallas_kernels.common (the reference every backend is tested against):
//   q        [T, Hq, D]             float32 or bfloat16; query head h*G + g uses KV head h (G = Hq / Hkv)
//   kv_pages [P, Hkv, S, 2D]        same dtype as q; K then V of one slot along the last axis
//   kv_lens  [N] i32, block_tables [N, MB] i32, cu_q_lens [N + 1] i32, num_seqs [1] i32
//   out      [T, Hq, D]             query i of sequence s sits at position kv_lens[s] - q_len + i and sees keys
//                                   p <= that position (and p > position - window with a sliding window);
//                                   rows of padding tokens (t >= cu_q_lens[num_seqs]) are zeros.
// Scores are accumulated in float32: s = (q . k) * sm_scale, then soft_cap * tanh(s / soft_cap) if soft_cap > 0.
// Slots past kv_len and pages past a sequence's last block are never read (they may hold anything, NaN too).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim, num_pages, num_kv_heads, page_size, max_seqs, max_blocks;
  int64_t group;
  float sm_scale, soft_cap;
  int64_t window;  // 0: none
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* cu_q_lens;
  int32_t num_seqs;
};

// One work item: sequence `seq`, KV head `head`, its query tokens [t0, t1) (absolute token indices).
struct Item {
  int32_t seq, head, t0, t1;
};

// Query tokens per item: decode items hold one token; prefill rows are cut so that their accumulators
// (rows x head_dim floats) stay in L1/L2 and the items spread over the threads.
constexpr int32_t kTokensPerItem = 32;
// How many pages ahead of the one being computed are requested from memory (see run_item).
constexpr int64_t kPrefetchPages = 4;

// exp(x) for x <= 0 to about 2 ulp, branch-free so that loops over it vectorize (std::exp does not without
// -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n by the
// exponent bits. Below -87 the result is 0 (the exact value is below float32's normal range).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187045e-06f, x));
  float y = 1.0f / 720.0f;
  y = std::fma(y, r, 1.0f / 120.0f);
  y = std::fma(y, r, 1.0f / 24.0f);
  y = std::fma(y, r, 1.0f / 6.0f);
  y = std::fma(y, r, 0.5f);
  y = std::fma(y, r, 1.0f);
  y = std::fma(y, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

template <typename T>
void to_floats(const T* src, int64_t n, float* dst) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void run_item(const Problem& p, const T* q, const T* kv, T* out, const Item& it, std::vector<float>& scratch) {
  const int64_t D = p.head_dim, G = p.group, S = p.page_size;
  const int32_t len = p.kv_lens[it.seq];
  const int32_t q_len = p.cu_q_lens[it.seq + 1] - p.cu_q_lens[it.seq];
  const int64_t tokens = it.t1 - it.t0;
  const int64_t rows = tokens * G;  // row t * G + g: query token it.t0 + t, query head it.head * G + g
  // scratch: q rows | acc rows | m | l | one page's scores (G x S) | one K or V row in float32
  scratch.resize(static_cast<size_t>(rows * D * 2 + rows * 2 + G * S + D));
  float* qf = scratch.data();
  float* acc = qf + rows * D;
  float* m = acc + rows * D;
  float* l = m + rows;
  float* sc = l + rows;
  float* row = sc + G * S;
  for (int64_t t = 0; t < tokens; ++t) {
    to_floats(q + ((it.t0 + t) * p.num_q_heads + it.head * G) * D, G * D, qf + t * G * D);
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);
  // Positions of the item's first and last query tokens, and the keys any of them can see: [lo, hi].
  const int64_t pos0 = (len - q_len) + (it.t0 - p.cu_q_lens[it.seq]);
  const int64_t pos1 = pos0 + tokens - 1;
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
  const int64_t hi = std::min<int64_t>(pos1, len - 1);
  const int32_t* table = p.tables + static_cast<int64_t>(it.seq) * p.max_blocks;
  for (int64_t blk = lo / S; blk <= hi / S && blk < p.max_blocks; ++blk) {
    const int64_t page = table[blk];
    if (page < 0 || page >= p.num_pages) continue;  // a corrupt table never reads out of bounds
    const T* base = kv + (page * p.num_kv_heads + it.head) * S * 2 * D;
    // Pages are scattered, so the hardware prefetcher cannot see the next one coming: ask for it now, while
    // this one is computed (decode is bound by memory latency, not bandwidth, with one stream per thread).
    for (int64_t ahead = (blk == lo / S ? 1 : kPrefetchPages); ahead <= kPrefetchPages; ++ahead) {
      if (blk + ahead > hi / S || blk + ahead >= p.max_blocks) break;
      const int64_t next = table[blk + ahead];
      if (next < 0 || next >= p.num_pages) continue;
      const char* np = reinterpret_cast<const char*>(kv + (next * p.num_kv_heads + it.head) * S * 2 * D);
      for (int64_t b = 0; b < static_cast<int64_t>(S * 2 * D * sizeof(T)); b += 64) __builtin_prefetch(np + b);
    }
    const int64_t k0 = blk * S;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t pos = pos0 + t;
      // This token's visible slots of the page: [j0, j1) (the same for its G query heads).
      const int64_t j0 = std::max<int64_t>(0, (p.window > 0 ? pos - p.window + 1 : 0) - k0);
      const int64_t j1 = std::min<int64_t>(S, std::min<int64_t>(pos, len - 1) - k0 + 1);
      if (j0 >= j1) continue;
      const float* qt = qf + t * G * D;
      for (int64_t j = j0; j < j1; ++j) {
        to_floats(base + j * 2 * D, D, row);
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qt + g * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * row[d];
          float x = dot * p.sm_scale;
          if (p.soft_cap > 0.0f) x = p.soft_cap * std::tanh(x / p.soft_cap);
          sc[g * S + j] = x;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g;
        float* s = sc + g * S;
        float page_max = -INFINITY;
        for (int64_t j = j0; j < j1; ++j) page_max = std::max(page_max, s[j]);
        const float m_new = std::max(m[r], page_max);
        const float alpha = std::exp(m[r] - m_new);  // exp(-inf) = 0 on the first visible page
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = j0; j < j1; ++j) {
          s[j] = exp_nonpositive(s[j] - m_new);
          sum += s[j];
        }
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        float* a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      }
      for (int64_t j = j0; j < j1; ++j) {
        to_floats(base + j * 2 * D + D, D, row);
        for (int64_t g = 0; g < G; ++g) {
          const float e = sc[g * S + j];
          float* a = acc + (t * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += e * row[d];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.t0 + r / G, g = r % G;
    T* dst = out + (t * p.num_q_heads + it.head * G + g) * D;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) from_float(acc[r * D + d] * inv, dst + d);
  }
}

// Runs fn(i) for i in [0, n) on the caller and on up to `threads - 1` tasks of XLA's intra-op pool, items handed
// out one at a time (decode items are tiny and many; prefill items are few and large).
//
// The caller never waits for a task that has not started: XLA may run several custom calls at once (independent
// ops of one computation), each on a pool thread, so a task can sit queued behind the very calls waiting for it.
// The caller works through the items itself and then waits only for tasks that are inside an item. A task
// registers (`active`) before it claims an item; one that starts after every item is claimed finds none and
// touches nothing but the shared state it co-owns, so it may outlive the call.
struct ForState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
  std::mutex mu;
  std::condition_variable cv;
};

template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  auto state = std::make_shared<ForState>();
  const Fn* body = &fn;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([state, body, n] {
      state->active.fetch_add(1);
      for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) (*body)(i);
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->active.fetch_sub(1) == 1) state->cv.notify_all();
    });
  }
  for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) fn(i);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->active.load() == 0; });
}

template <typename T>
void run(ffi::ThreadPool& pool, const Problem& p, const T* q, const T* kv, T* out) {
  std::memset(out, 0, sizeof(T) * p.num_tokens * p.num_q_heads * p.head_dim);
  std::vector<Item> items;
  const int32_t n = std::min<int32_t>(p.num_seqs, static_cast<int32_t>(p.max_seqs));
  for (int32_t s = 0; s < n; ++s) {
    const int32_t t0 = std::max(0, p.cu_q_lens[s]);
    const int32_t t1 = std::min<int32_t>(p.cu_q_lens[s + 1], static_cast<int32_t>(p.num_tokens));
    for (int32_t a = t0; a < t1; a += kTokensPerItem) {
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        items.push_back({s, h, a, std::min(t1, a + kTokensPerItem)});
      }
    }
  }
  parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local std::vector<float> scratch;
    run_item(p, q, kv, out, items[i], scratch);
  });
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages, ffi::Buffer<ffi::S32> kv_lens,
                ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                float sm_scale, float soft_cap, int64_t sliding_window, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions();
  auto kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || kd[3] != 2 * qd[2] || qd[1] % kd[1] != 0) {
    return ffi::Error::InvalidArgument("paged_attention: q [T, Hq, D] and kv_pages [P, Hkv, S, 2D] disagree");
  }
  if (q.element_type() != kv_pages.element_type() || out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention: q, kv_pages and out must share one dtype");
  }
  Problem p;
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_pages = kd[0];
  p.num_kv_heads = kd[1];
  p.page_size = kd[2];
  p.group = p.num_q_heads / p.num_kv_heads;
  p.max_seqs = kv_lens.dimensions()[0];
  p.max_blocks = block_tables.dimensions()[1];
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  p.kv_lens = kv_lens.typed_data();
  p.tables = block_tables.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.num_seqs = num_seqs.typed_data()[0];
  switch (q.element_type()) {
    case ffi::F32:
      run(pool, p, static_cast<const float*>(q.untyped_data()), static_cast<const float*>(kv_pages.untyped_data()),
          static_cast<float*>(out->untyped_data()));
      return ffi::Error::Success();
    case ffi::BF16:
      run(pool, p, static_cast<const uint16_t*>(q.untyped_data()),
          static_cast<const uint16_t*>(kv_pages.untyped_data()), static_cast<uint16_t*>(out->untyped_data()));
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("paged_attention: q and kv_pages must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::AnyBuffer>());
