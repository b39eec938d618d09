// swap_pages: three mremap calls per row; see remap.h.
#include "copy/remap.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux >= 5.7
#endif

namespace nereus {
namespace {

constexpr uintptr_t kHugePageBytes = uintptr_t{2} << 20;

void* move(void* from, size_t n, void* to, int extra) {
  return mremap(from, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | extra, to);
}

// A PROT_NONE scratch range of n bytes at the same offset within a 2 MiB huge page
// as `like`: the kernel moves a transparent huge page whole (one PMD) only between
// addresses that agree modulo 2 MiB, and splits it into 4 KiB pages otherwise, so an
// unaligned scratch range would leave b's old pages (which go back to a) small.
void* scratch_like(void* like, size_t n) {
  const size_t slack = kHugePageBytes;
  void* raw =
      mmap(nullptr, n + slack, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return raw;
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t phase = reinterpret_cast<uintptr_t>(like) % kHugePageBytes;
  const uintptr_t at = base + ((phase - base % kHugePageBytes) + kHugePageBytes) % kHugePageBytes;
  if (at > base) munmap(raw, at - base);
  if (base + n + slack > at + n) munmap(reinterpret_cast<void*>(at + n), base + n + slack - at - n);
  return reinterpret_cast<void*>(at);
}

int swap_one(void* a, void* b, size_t n) {
  void* tmp = scratch_like(b, n);
  if (tmp == MAP_FAILED) return errno;
  if (move(b, n, tmp, MREMAP_DONTUNMAP) == MAP_FAILED) {
    const int err = errno;
    munmap(tmp, n);
    return err;
  }
  if (move(a, n, b, MREMAP_DONTUNMAP) == MAP_FAILED) {
    const int err = errno;
    // b's pages go back; if even that fails b stays mapped and empty, which only
    // loses b's old bytes (a destination's, about to be overwritten by a copy).
    if (move(tmp, n, b, 0) == MAP_FAILED) munmap(tmp, n);
    return err;
  }
  // a's bytes are at b now; should this last move fail, a stays mapped and empty.
  if (move(tmp, n, a, 0) == MAP_FAILED) munmap(tmp, n);
  return 0;
}

}  // namespace

SwapResult swap_pages(const SwapRow* rows, int64_t num_rows) {
  for (int64_t i = 0; i < num_rows; ++i) {
    const SwapRow& r = rows[i];
    if (r.nbytes == 0) continue;
    const int err = swap_one(reinterpret_cast<void*>(r.a), reinterpret_cast<void*>(r.b),
                             static_cast<size_t>(r.nbytes));
    if (err != 0) return {i, err};
  }
  return {num_rows, 0};
}

}  // namespace nereus
