// Cross-memory attach (process_vm_readv) over the region tables of copy_regions: the
// kernel copies each row straight from the peer's pages into ours, one copy, no
// shared segment, no system call per row (rows are batched kCmaMaxIovecs at a time).
#include "copy/cma.h"

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <thread>
#include <vector>

#include "common.h"

namespace nereus {
namespace {

// Rows of one thread's byte range, batched into process_vm_readv calls.
class Reader {
 public:
  explicit Reader(int pid) : pid_(pid) {
    local_.reserve(kCmaMaxIovecs);
    remote_.reserve(kCmaMaxIovecs);
  }

  // Queues one run of n bytes; false once a call has failed.
  bool add(int64_t src, int64_t dst, int64_t n) {
    if (error_ != 0) return false;
    local_.push_back({reinterpret_cast<void*>(dst), static_cast<size_t>(n)});
    remote_.push_back({reinterpret_cast<void*>(src), static_cast<size_t>(n)});
    if (static_cast<int>(local_.size()) == kCmaMaxIovecs) flush();
    return error_ == 0;
  }

  // Issues the queued runs; a short read (a remote range that ended early) resumes
  // where it stopped, so the next call reports the failing range's errno.
  void flush() {
    size_t first = 0;
    while (first < local_.size() && error_ == 0) {
      const auto count = static_cast<unsigned long>(local_.size() - first);
      ssize_t got = process_vm_readv(pid_, &local_[first], count, &remote_[first], count, 0);
      if (got < 0) {
        error_ = errno;
        break;
      }
      if (got == 0) {
        error_ = EFAULT;
        break;
      }
      bytes_ += got;
      // Both lists hold the same run lengths: skip what was read on both.
      auto left = static_cast<size_t>(got);
      while (first < local_.size() && left >= local_[first].iov_len)
        left -= local_[first++].iov_len;
      if (left) {
        for (auto* v : {&local_[first], &remote_[first]}) {
          v->iov_base = static_cast<char*>(v->iov_base) + left;
          v->iov_len -= left;
        }
      }
    }
    local_.clear();
    remote_.clear();
  }

  int64_t bytes() const { return bytes_; }
  int error() const { return error_; }

 private:
  int pid_;
  std::vector<iovec> local_;
  std::vector<iovec> remote_;
  int64_t bytes_ = 0;
  int error_ = 0;
};

// Reads bytes [begin, end) of the table's concatenated byte stream (as copy_range).
CmaResult read_range(int pid, const std::vector<CopyRegion>& regions,
                     const std::vector<int64_t>& prefix, int64_t begin, int64_t end) {
  Reader reader(pid);
  if (begin < end) {
    auto it = std::upper_bound(prefix.begin(), prefix.end(), begin);
    size_t i = (it - prefix.begin()) - 1;
    int64_t pos = begin;
    bool ok = true;
    while (ok && pos < end && i < regions.size()) {
      const CopyRegion& r = regions[i];
      int64_t offset = pos - prefix[i];
      int64_t row = offset / r.row_bytes;
      int64_t col = offset % r.row_bytes;
      while (ok && pos < end && pos < prefix[i + 1]) {
        int64_t n = std::min(r.row_bytes - col, end - pos);
        ok = reader.add(r.src_addr + row * r.src_stride_bytes + col,
                        r.dst_addr + row * r.dst_stride_bytes + col, n);
        pos += n;
        col = 0;
        ++row;
      }
      ++i;
    }
    reader.flush();
  }
  return {reader.bytes(), reader.error()};
}

}  // namespace

CmaResult cma_read(int pid, const CopyRegion* table, int64_t num_regions, int num_threads) {
  NEREUS_CHECK(pid > 0, "pid=" << pid << "; pass the peer process's id");
  std::vector<int64_t> prefix;
  std::vector<CopyRegion> regions = normalize_regions(table, num_regions, &prefix);
  const int64_t total = prefix.back();
  const int num_parts = copy_num_parts(total, num_threads);
  // Part boundaries on 4 KiB keep two threads off one page (each faults its own in).
  auto boundary = [&](int p) {
    if (p == num_parts) return total;
    return (total / num_parts * p) & ~static_cast<int64_t>(4095);
  };
  std::vector<CmaResult> results(num_parts, CmaResult{0, 0});
  std::vector<std::thread> threads;
  threads.reserve(num_parts - 1);
  for (int p = 1; p < num_parts; ++p)
    threads.emplace_back(
        [&, p] { results[p] = read_range(pid, regions, prefix, boundary(p), boundary(p + 1)); });
  results[0] = read_range(pid, regions, prefix, boundary(0), boundary(1));
  for (auto& t : threads) t.join();
  CmaResult out{0, 0};
  for (const auto& r : results) {
    out.bytes += r.bytes;
    if (out.error == 0) out.error = r.error;
  }
  return out;
}

}  // namespace nereus
