// The shared pieces of the CPU paged-attention kernel: the problem, one work item, and how an item finds the
// K/V rows of its sequence in the pages (see paged_attention.cc for the semantics).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace pja {

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim, num_pages, num_kv_heads, page_size, max_seqs, max_blocks;
  int64_t group;             // query heads per KV head
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* cu_q_lens;
  int32_t num_seqs;
  const float* scales;  // quantized pages: [num_pages, num_kv_heads * 2 * page_size]; else null
};

// One work item: query tokens [t0, t1) (absolute token indices) of sequence `seq` with the query heads of KV
// head `head`, over the key positions [lo, hi] (the keys any of its tokens can see, or one part of them when a
// sequence's keys are split across threads). Rows are r = t * group + g (token t - t0, query head head*group+g).
// partial < 0: the item writes its output rows; else it writes its unnormalized softmax state (m [R], l [R],
// acc [R, D]) at float offset `partial` of the call's partials buffer and the caller merges the parts.
struct Item {
  int32_t seq, head, t0, t1;
  int64_t lo, hi;
  int64_t partial;
};

// Online-softmax state of an item's rows: running max m, denominator l, unnormalized output acc [rows, D].
struct RowState {
  float* m;
  float* l;
  float* acc;
};

// Where the K and V rows of one sequence and KV head are: key position pos lives in page table[pos / S], slot
// pos % S; its K row is row(pos)[0, D) and its V row row(pos)[D, 2D).
template <typename T>
struct KvRows {
  const T* kv;
  const float* scales;  // null for float pages
  const int32_t* table;
  int64_t S, D, head, num_kv_heads, num_pages, max_blocks;

  KvRows(const Problem& p, const T* pages, int32_t seq, int32_t kv_head)
      : kv(pages),
        scales(p.scales),
        table(p.tables + static_cast<int64_t>(seq) * p.max_blocks),
        S(p.page_size),
        D(p.head_dim),
        head(kv_head),
        num_kv_heads(p.num_kv_heads),
        num_pages(p.num_pages),
        max_blocks(p.max_blocks) {}

  // The page of position pos, or -1 when its table entry is outside the cache (a corrupt table never reads out
  // of bounds: those keys count as absent).
  int64_t page(int64_t pos) const {
    const int64_t blk = pos / S;
    if (blk >= max_blocks) return -1;
    const int64_t pg = table[blk];
    return pg < 0 || pg >= num_pages ? -1 : pg;
  }
  const T* row(int64_t pg, int64_t pos) const { return kv + ((pg * num_kv_heads + head) * S + pos % S) * 2 * D; }
  // Per-key dequantization scales of K (kv = 0) and V (kv = 1); 1 for float pages.
  float scale(int64_t pg, int64_t pos, int kv_index) const {
    if (scales == nullptr) return 1.0f;
    return scales[pg * num_kv_heads * 2 * S + (2 * head + kv_index) * S + pos % S];
  }
  // The scales of K (kv = 0) or V (kv = 1) from position pos on, consecutive within its page; null for float
  // pages.
  const float* scales_of(int64_t pg, int64_t pos, int kv_index) const {
    if (scales == nullptr) return nullptr;
    return scales + pg * num_kv_heads * 2 * S + (2 * head + kv_index) * S + pos % S;
  }
  // End of the run of positions from `pos` that share its page, capped at `end`.
  int64_t run_end(int64_t pos, int64_t end) const { return std::min(end, (pos / S + 1) * S); }

  // Asks the memory system for the rows of positions [a, e) (pages are scattered, so the hardware prefetcher
  // cannot see the next one coming); by default into L2, as a block is read twice (K, then V) after it arrives
  // (Locality as __builtin_prefetch's: 3 is prefetcht0, into L1 as well).
  template <int Locality = 2>
  void prefetch(int64_t a, int64_t e) const {
    for (int64_t pos = a; pos < e;) {
      const int64_t stop = run_end(pos, e);
      const int64_t pg = page(pos);
      if (pg >= 0) prefetch_bytes<Locality>(row(pg, pos), (stop - pos) * row_bytes());
      pos = stop;
    }
  }
  // The K|V rows of the positions [a, e) whose page exists, in order, into out; returns how many.
  int64_t rows(int64_t a, int64_t e, const T** out) const {
    int64_t n = 0;
    for (int64_t pos = a; pos < e;) {
      const int64_t stop = run_end(pos, e);
      const int64_t pg = page(pos);
      if (pg >= 0) {
        const T* r = row(pg, pos);
        for (int64_t j = 0; j < stop - pos; ++j) out[n++] = r + j * 2 * D;
      }
      pos = stop;
    }
    return n;
  }
  int64_t row_bytes() const { return 2 * D * static_cast<int64_t>(sizeof(T)); }
  template <int Locality = 2>
  static void prefetch_bytes(const void* p, int64_t bytes) {
    const char* b = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(b + off, 0, Locality);
  }
};

}  // namespace pja
