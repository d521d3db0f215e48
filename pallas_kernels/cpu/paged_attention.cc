// Ragged paged attention for XLA:CPU as an XLA FFI custom call: every page is read once, in place.
//
// Why a C++ kernel: on CPU the XLA formulation (pallas_kernels/xla_paged.py) must gather pages into a
// contiguous buffer before each batched dot (XLA cannot fuse a gather into a dot), and the dots over tiny
// per-(sequence, KV head) matrices then re-read that copy twice. Here each work item (one sequence, one KV head,
// a block of its query tokens, a range of its keys) walks its pages through the block table: decode items as
// register tiles over the pages in place (decode.h), prefill items as blocked matrix products over K/V widened
// once per block (prefill.h). The instruction set is the build's (simd.h).
//
// Semantics are those of pallas_kernels.common (the reference every backend is tested against):
//   q        [T, Hq, D]             float32 or bfloat16; query head h*G + g uses KV head h (G = Hq / Hkv)
//   kv_pages [P, Hkv, S, 2D]        q's dtype, or int8 / float8_e4m3fn with
//   scales   [P, Hkv * 2 * S] f32   (PagedAttentionQuantized only) the scale of K (kv = 0) or V (kv = 1) of head
//                                   h in slot s at [p, (2h + kv) * S + s] (pallas_kernels/kv_quant.py)
//   kv_lens  [N] i32, block_tables [N, MB] i32, cu_q_lens [N + 1] i32, num_seqs [1] i32
//   out      [T, Hq, D]             q's dtype. Query i of sequence s sits at position kv_lens[s] - q_len + i and
//                                   sees keys p <= that position (and p > position - window with a sliding
//                                   window); rows of padding tokens (t >= cu_q_lens[num_seqs]) are zeros.
// Scores are accumulated in float32: s = (q . k) * k_scale * sm_scale, then soft_cap * tanh(s / soft_cap) if
// soft_cap > 0; probabilities multiply V * v_scale. Slots past kv_len and pages past a sequence's last block are
// never read (they may hold anything, NaN too); a NaN in a visible key or a query makes that row NaN.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode.h"
#include "parallel.h"
#include "prefill.h"
#include "problem.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"
#include "zero_pages.h"

namespace ffi = xla::ffi;

namespace pja {
namespace {

// Query tokens per prefill item: their rows (tokens x group) are the M of the item's matrix products; the items
// still spread over the threads.
constexpr int32_t kTokensPerItem = 32;
// A sequence's keys are split across threads only when there are fewer than kItemsPerThread items per thread,
// and into parts of at least kMinPartKeys keys (a part's merge costs a few rows of head_dim).
constexpr int64_t kItemsPerThread = 2;
constexpr int64_t kMinPartKeys = 512;

// `next`: the item this thread runs after this one (null if none or unknown); a decode item prefetches the
// first block of a decode `next` while it computes its own last block.
template <typename TQ, typename T>
void run_item(const Problem& p, const TQ* q, const T* kv, TQ* out, const Item& it, float* partials, const Item* next) {
  const int64_t D = p.head_dim, G = p.group;
  const int64_t tokens = it.t1 - it.t0, R = tokens * G;
  const int32_t len = p.kv_lens[it.seq];
  const int32_t q_len = p.cu_q_lens[it.seq + 1] - p.cu_q_lens[it.seq];
  const int64_t pos0 = (len - q_len) + (it.t0 - p.cu_q_lens[it.seq]);
  const bool decode = tokens == 1;
  thread_local std::vector<float> scratch;
  thread_local std::vector<int32_t> rowpos;
  // scratch: q rows [R, D] | m [R] | l [R] | acc [R, D] | the item kind's own
  const int64_t own = decode ? decode_scratch(G) : prefill_scratch(R, D);
  scratch.resize(static_cast<size_t>(2 * R * D + 2 * R + own));
  float* qf = scratch.data();
  const RowState st{qf + R * D, qf + R * D + R, qf + R * D + 2 * R};
  float* work = st.acc + R * D;
  const TQ* qsrc = q + (it.t0 * p.num_q_heads + it.head * G) * D;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < G * D; ++i) qf[t * G * D + i] = to_float(qsrc[t * p.num_q_heads * D + i]);
  }
  std::fill(st.m, st.m + R, -INFINITY);
  std::fill(st.l, st.l + R, 0.0f);
  std::fill(st.acc, st.acc + R * D, 0.0f);
  const KvRows<T> rows(p, kv, it.seq, it.head);
  if (decode) {
    const uint16_t* qb = nullptr;  // the bfloat16 query itself, for vdpbf16ps on bfloat16 pages
    if constexpr (std::is_same_v<TQ, uint16_t>) qb = qsrc;
    if (next != nullptr && next->t1 - next->t0 == 1) {
      const KvRows<T> after(p, kv, next->seq, next->head);
      decode_item(p, rows, qf, qb, it.lo, it.hi, st, work, &after, next->lo, next->hi);
    } else {
      decode_item(p, rows, qf, qb, it.lo, it.hi, st, work);
    }
  } else {
    rowpos.resize(static_cast<size_t>(round_up(R, W)));
    prefill_item(p, rows, qf, R, pos0, it.lo, it.hi, st, work, rowpos.data());
  }
  if (it.partial >= 0) {  // merged by merge_parts
    float* dst = partials + it.partial;
    std::copy(st.m, st.m + R * (D + 2), dst);  // m | l | acc are contiguous
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    TQ* o = out + ((it.t0 + r / G) * p.num_q_heads + it.head * G + r % G) * D;
    const float inv = st.l[r] > 0.0f ? 1.0f / st.l[r] : (st.l[r] == 0.0f ? 0.0f : st.l[r]);  // NaN stays NaN
    int64_t d = 0;
    for (; d + W <= D; d += W) store(o + d, load(st.acc + r * D + d) * inv);
    for (; d < D; ++d) from_float(st.acc[r * D + d] * inv, o + d);
  }
}

// The parts [first, first + count) of one item's keys, each a softmax state of R rows, combined into its output.
template <typename TQ>
void merge_parts(const Problem& p, const Item& it, int64_t count, const float* partials, TQ* out) {
  const int64_t D = p.head_dim, G = p.group, R = (it.t1 - it.t0) * G;
  const float* base = partials + it.partial;  // the parts' states follow each other
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t r = 0; r < R; ++r) {
    float m = -INFINITY;
    for (int64_t k = 0; k < count; ++k) m = std::max(m, base[k * R * (D + 2) + r]);
    float l = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < count; ++k) {
      const float* part = base + k * R * (D + 2);
      const float mk = part[r], lk = part[R + r];
      if (lk == 0.0f && mk == -INFINITY) continue;  // a part whose pages were all absent
      const float w = exp_nonpositive(mk - m);
      l += lk * w;
      for (int64_t d = 0; d < D; ++d) acc[d] += part[2 * R + r * D + d] * w;
    }
    TQ* o = out + ((it.t0 + r / G) * p.num_q_heads + it.head * G + r % G) * D;
    const float inv = l > 0.0f ? 1.0f / l : (l == 0.0f ? 0.0f : l);
    for (int64_t d = 0; d < D; ++d) from_float(acc[d] * inv, o + d);
  }
}

// The work items: sequence x block of kTokensPerItem query tokens (decode: one) x KV head, each over the keys its
// tokens see. With fewer than kItemsPerThread items per thread (batch 1, few KV heads), long key ranges are cut
// into parts that run on different threads; `groups` gets (first part, part count) of every cut item.
std::vector<Item> make_items(const Problem& p, int64_t threads, std::vector<std::pair<int64_t, int64_t>>& groups) {
  std::vector<Item> items;
  const int32_t n = std::min<int32_t>(p.num_seqs, static_cast<int32_t>(p.max_seqs));
  for (int32_t s = 0; s < n; ++s) {
    const int32_t t0 = std::max(0, p.cu_q_lens[s]);
    const int32_t t1 = std::min<int32_t>(p.cu_q_lens[s + 1], static_cast<int32_t>(p.num_tokens));
    const int32_t len = p.kv_lens[s], q_len = p.cu_q_lens[s + 1] - p.cu_q_lens[s];
    for (int32_t a = t0; a < t1; a += kTokensPerItem) {
      const int32_t b = std::min(t1, a + kTokensPerItem);
      const int64_t pos0 = (len - q_len) + (a - p.cu_q_lens[s]), pos1 = pos0 + (b - a) - 1;
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
      const int64_t hi = std::min<int64_t>(pos1, len - 1);
      for (int32_t h = 0; h < p.num_kv_heads; ++h) items.push_back({s, h, a, b, lo, hi, -1});
    }
  }
  const int64_t want = kItemsPerThread * threads;
  if (threads < 2 || items.empty() || static_cast<int64_t>(items.size()) >= want) return items;
  const int64_t parts = (want + static_cast<int64_t>(items.size()) - 1) / static_cast<int64_t>(items.size());
  std::vector<Item> cut;
  int64_t offset = 0;
  for (const Item& it : items) {
    const int64_t span = it.hi - it.lo + 1;
    const int64_t k = std::min(parts, span / kMinPartKeys);
    if (k < 2) {
      cut.push_back(it);
      continue;
    }
    groups.emplace_back(static_cast<int64_t>(cut.size()), k);
    for (int64_t i = 0; i < k; ++i) {
      Item part = it;
      part.lo = it.lo + round_up(span * i / k, kPrefillBlock);
      part.hi = i + 1 == k ? it.hi : it.lo + round_up(span * (i + 1) / k, kPrefillBlock) - 1;
      part.partial = offset;
      offset += (it.t1 - it.t0) * p.group * (p.head_dim + 2);
      cut.push_back(part);
    }
  }
  return cut;
}

template <typename TQ, typename T>
void run(ffi::ThreadPool& pool, const Problem& p, const TQ* q, const T* kv, TQ* out) {
  std::memset(out, 0, sizeof(TQ) * p.num_tokens * p.num_q_heads * p.head_dim);
  std::vector<std::pair<int64_t, int64_t>> groups;
  const std::vector<Item> items = make_items(p, pool.num_threads(), groups);
  int64_t partial_floats = 0;
  for (const Item& it : items) {
    if (it.partial >= 0) partial_floats += (it.t1 - it.t0) * p.group * (p.head_dim + 2);
  }
  std::vector<float> partials(static_cast<size_t>(partial_floats));
  parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i, int64_t next) {
    run_item(p, q, kv, out, items[i], partials.data(), next >= 0 ? &items[next] : nullptr);
  });
  for (const auto& [first, count] : groups) merge_parts(p, items[first], count, partials.data(), out);
}

// Problem fields from the operands; an error names what disagrees.
ffi::Error make_problem(ffi::AnyBuffer& q, ffi::AnyBuffer& kv_pages, ffi::Buffer<ffi::S32>& kv_lens,
                        ffi::Buffer<ffi::S32>& block_tables, ffi::Buffer<ffi::S32>& cu_q_lens,
                        ffi::Buffer<ffi::S32>& num_seqs, float sm_scale, float soft_cap, int64_t sliding_window,
                        Problem& p) {
  auto qd = q.dimensions();
  auto kd = kv_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || kd[3] != 2 * qd[2] || qd[1] % kd[1] != 0) {
    return ffi::Error::InvalidArgument("paged_attention: q [T, Hq, D] and kv_pages [P, Hkv, S, 2D] disagree");
  }
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
  p.scales = nullptr;
  return ffi::Error::Success();
}

template <typename TQ>
ffi::Error dispatch_pages(ffi::ThreadPool& pool, const Problem& p, ffi::AnyBuffer& q, ffi::AnyBuffer& kv_pages,
                          ffi::AnyBuffer& out) {
  const TQ* qp = static_cast<const TQ*>(q.untyped_data());
  TQ* op = static_cast<TQ*>(out.untyped_data());
  const void* kv = kv_pages.untyped_data();
  switch (kv_pages.element_type()) {
    case ffi::S8:
      run(pool, p, qp, static_cast<const int8_t*>(kv), op);
      return ffi::Error::Success();
    case ffi::F8E4M3FN:
      run(pool, p, qp, static_cast<const Fp8*>(kv), op);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("paged_attention: quantized kv_pages must be int8 or float8_e4m3fn");
  }
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages, ffi::Buffer<ffi::S32> kv_lens,
                ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                float sm_scale, float soft_cap, int64_t sliding_window, ffi::Result<ffi::AnyBuffer> out) {
  Problem p;
  ffi::Error err =
      make_problem(q, kv_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale, soft_cap, sliding_window, p);
  if (err.failure()) return err;
  if (q.element_type() != kv_pages.element_type() || out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention: q, kv_pages and out must share one dtype");
  }
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

ffi::Error ImplQuantized(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages, ffi::Buffer<ffi::F32> scales,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
                         ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs, float sm_scale,
                         float soft_cap, int64_t sliding_window, ffi::Result<ffi::AnyBuffer> out) {
  Problem p;
  ffi::Error err =
      make_problem(q, kv_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sm_scale, soft_cap, sliding_window, p);
  if (err.failure()) return err;
  auto sd = scales.dimensions();
  if (sd.size() != 2 || sd[0] != p.num_pages || sd[1] != p.num_kv_heads * 2 * p.page_size) {
    return ffi::Error::InvalidArgument("paged_attention: scales must be [P, Hkv * 2 * S]");
  }
  p.scales = scales.typed_data();
  if (out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("paged_attention: q and out must share one dtype");
  }
  switch (q.element_type()) {
    case ffi::F32:
      return dispatch_pages<float>(pool, p, q, kv_pages, *out);
    case ffi::BF16:
      return dispatch_pages<uint16_t>(pool, p, q, kv_pages, *out);
    default:
      return ffi::Error::InvalidArgument("paged_attention: q must be float32 or bfloat16");
  }
}

}  // namespace
}  // namespace pja

// The instruction-set path this library was built for ("avx512+bf16", "avx512", "avx2" or "generic").
extern "C" const char* PagedAttentionIsa() { return pja::kHasBf16Dot ? "avx512+bf16" : pja::kIsa; }

// exp_nonpositive on n floats (tests pin its accuracy and its edges: below -87 and -inf give 0, NaN gives NaN).
extern "C" void PagedAttentionExp(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = pja::exp_nonpositive(x[i]);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, pja::Impl,
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionQuantized, pja::ImplQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // kv_pages (int8 / float8_e4m3fn)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::AnyBuffer>());

// A zeroed buffer whose whole pages are mapped lazily (zero_pages.h): the CPU KV cache's allocation.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ZeroPages, pja::ZeroPagesImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
