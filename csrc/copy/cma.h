// Cross-memory attach: read another process's memory straight into this one's.
#pragma once

#include <cstdint>

#include "copy/host_copy.h"

namespace nereus {

// What cma_read moved: bytes read, and the errno of the first failed call (0: none).
struct CmaResult {
  int64_t bytes;
  int error;
};

// process_vm_readv accepts at most this many iovecs per side and call (IOV_MAX).
constexpr int kCmaMaxIovecs = 1024;

// Reads every region of a copy table from process `pid` into this process: src_addr
// and src_stride_bytes are in pid's address space, dst_addr and dst_stride_bytes in
// ours. The bytes are split evenly over up to num_threads threads (the caller is one;
// <= 0: copy_default_num_threads()), each issuing process_vm_readv calls of up to
// kCmaMaxIovecs rows. Stops a thread at its first failed call and returns its errno.
CmaResult cma_read(int pid, const CopyRegion* regions, int64_t num_regions, int num_threads);

}  // namespace nereus
