// swap_pages: three mremap calls per row; see remap.h.
#include "copy/remap.h"

#include <sys/mman.h>

#include <cerrno>

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4  // Linux >= 5.7
#endif

namespace nereus {
namespace {

void* move(void* from, size_t n, void* to, int extra) {
  return mremap(from, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | extra, to);
}

int swap_one(void* a, void* b, size_t n) {
  void* tmp = mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
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
