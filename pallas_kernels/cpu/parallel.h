// parallel_for over XLA's intra-op thread pool, shared by the CPU kernels (paged attention, the packed GEMM).

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace pja {

// Runs fn(i, next) for i in [0, n) on the caller and on up to `threads - 1` tasks of XLA's intra-op pool, items
// handed out one at a time (decode items are tiny and many; prefill items are few and large). While more than
// kAheadItems items per thread are left, a thread claims its next item before it runs the current one and `next`
// names it (else -1), so an item can prefetch for it. Near the end it claims one at a time: an item claimed ahead
// waits for the current one while another thread may idle (the two parts of a split sequence, or two prefill
// items, would run one after the other).
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

constexpr int64_t kAheadItems = 2;

// One thread's share of parallel_for: items until none is left.
template <typename Fn>
void drain_items(ForState& state, int64_t n, int64_t ahead_until, const Fn& fn) {
  for (int64_t i = state.next.fetch_add(1); i < n;) {
    int64_t j = i < ahead_until ? state.next.fetch_add(1) : -1;
    if (j >= n) j = -1;
    fn(i, j);
    i = j >= 0 ? j : state.next.fetch_add(1);
  }
}

template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n);
  const int64_t helpers = threads - 1;
  const int64_t ahead_until = n - kAheadItems * threads;  // items claimed ahead only before this index
  auto state = std::make_shared<ForState>();
  const Fn* body = &fn;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([state, body, n, ahead_until] {
      state->active.fetch_add(1);
      drain_items(*state, n, ahead_until, *body);
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->active.fetch_sub(1) == 1) state->cv.notify_all();
    });
  }
  drain_items(*state, n, ahead_until, fn);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->active.load() == 0; });
}

}  // namespace pja
