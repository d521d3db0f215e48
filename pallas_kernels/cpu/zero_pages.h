// A zeroed output buffer without writing it: the FFI handler ZeroPages behind pallas_kernels.cpu.zeros.
//
// Why: XLA:CPU fills `jnp.zeros` by writing every byte, so a 4 GiB KV cache costs seconds of page faults at
// start-up. Here the whole pages inside the buffer are replaced by a fresh private anonymous mapping
// (mmap MAP_FIXED), which the kernel guarantees reads as zeros and backs with memory only when a page is first
// written; the partial pages at the two ends are zeroed with memset. The result is exact zeros whatever the
// buffer held before and whatever mapping it came from; if the mmap fails the whole buffer is memset.

#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace pja {

inline xla::ffi::Error ZeroPagesImpl(xla::ffi::Result<xla::ffi::AnyBuffer> out) {
  auto* data = static_cast<char*>(out->untyped_data());
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + out->size_bytes();
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (begin + page - 1) / page * page;  // first whole page
  const uintptr_t hi = end / page * page;                 // end of the last whole page
  if (hi <= lo || mmap(reinterpret_cast<void*>(lo), hi - lo, PROT_READ | PROT_WRITE,
                       MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED) {
    std::memset(data, 0, out->size_bytes());
    return xla::ffi::Error::Success();
  }
  std::memset(data, 0, lo - begin);
  std::memset(reinterpret_cast<void*>(hi), 0, end - hi);
  return xla::ffi::Error::Success();
}

}  // namespace pja
