// Host copy over region tables: a persistent thread pool that splits a whole table
// by bytes, so one 64 MiB region uses every thread as well as 10,000 small ones do.
#include "copy/host_copy.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "common.h"

namespace nereus {
namespace {

// Workers sleep on a condition variable between calls; the caller runs part 0 itself
// so a call with P parts wakes only P - 1 threads.
class CopyPool {
 public:
  explicit CopyPool(int num_workers) {
    threads_.reserve(num_workers);
    for (int i = 0; i < num_workers; ++i) threads_.emplace_back([this, i] { worker_loop(i + 1); });
  }

  ~CopyPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int num_workers() const { return static_cast<int>(threads_.size()); }

  // Runs fn(0..num_parts-1), part 0 on the calling thread, and returns when all are done.
  void run(int num_parts, const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      num_parts_ = num_parts;
      pending_ = num_parts - 1;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void worker_loop(int part) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (part >= num_parts_) continue;
      const std::function<void(int)>* fn = fn_;
      lock.unlock();
      (*fn)(part);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int num_parts_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// Pointers, not objects: after fork() the child has no worker threads and possibly a
// mutex held by a parent thread, so the child handler drops both (leaking them) and
// starts fresh. The mutex doubles as "pool busy": a concurrent caller copies alone.
std::mutex* g_pool_mu = new std::mutex();
CopyPool* g_pool = nullptr;

void reset_pool_in_child() {
  g_pool_mu = new std::mutex();
  g_pool = nullptr;
}

const bool g_atfork_registered = [] {
  pthread_atfork(nullptr, nullptr, reset_pool_in_child);
  return true;
}();

// Copies bytes [begin, end) of the table's concatenated (packed) byte stream.
void copy_range(const CopyRegion* regions, const std::vector<int64_t>& prefix, int64_t begin,
                int64_t end) {
  if (begin >= end) return;
  // The region holding `begin`: the last one whose prefix is <= begin (skips empty ones).
  auto it = std::upper_bound(prefix.begin(), prefix.end(), begin);
  int64_t i = (it - prefix.begin()) - 1;
  int64_t pos = begin;
  while (pos < end) {
    const CopyRegion& r = regions[i];
    int64_t offset = pos - prefix[i];
    int64_t region_end = prefix[i + 1];
    if (offset >= 0 && pos < region_end) {
      int64_t row = offset / r.row_bytes;
      int64_t col = offset % r.row_bytes;
      while (pos < end && pos < region_end) {
        int64_t n = std::min(r.row_bytes - col, end - pos);
        std::memcpy(reinterpret_cast<char*>(r.dst_addr + row * r.dst_stride_bytes + col),
                    reinterpret_cast<const char*>(r.src_addr + row * r.src_stride_bytes + col),
                    static_cast<size_t>(n));
        pos += n;
        col = 0;
        ++row;
      }
    }
    ++i;
  }
}

}  // namespace

int copy_default_num_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::vector<CopyRegion> normalize_regions(const CopyRegion* table, int64_t num_regions,
                                          std::vector<int64_t>* prefix) {
  std::vector<CopyRegion> regions;
  regions.reserve(num_regions);
  for (int64_t i = 0; i < num_regions; ++i) {
    CopyRegion r = table[i];
    NEREUS_CHECK(r.num_rows >= 0 && r.row_bytes >= 0,
                 "region " << i << " has num_rows=" << r.num_rows << ", row_bytes=" << r.row_bytes
                           << "; both must be >= 0");
    if (r.num_rows == 0 || r.row_bytes == 0) continue;
    NEREUS_CHECK(r.src_addr > 0 && r.dst_addr > 0,
                 "region " << i
                           << " has a null address (or a negative one); pass data_ptr() of live "
                              "tensors");
    // The last byte of either side must be addressable without wrapping: rows may not
    // step backwards, and every offset the copy computes fits in int64.
    int64_t rows_bytes = 0;
    NEREUS_CHECK(!__builtin_mul_overflow(r.num_rows, r.row_bytes, &rows_bytes),
                 "region " << i << " has num_rows=" << r.num_rows << " x row_bytes=" << r.row_bytes
                           << ", which overflows int64");
    if (r.num_rows > 1) {
      NEREUS_CHECK(r.src_stride_bytes >= 0 && r.dst_stride_bytes >= 0,
                   "region " << i << " has strides " << r.src_stride_bytes << " and "
                             << r.dst_stride_bytes << "; strides of a multi-row region are >= 0");
    } else {
      r.src_stride_bytes = r.dst_stride_bytes = r.row_bytes;  // unused: one row
    }
    for (const auto& [addr, stride] :
         {std::pair{r.src_addr, r.src_stride_bytes}, std::pair{r.dst_addr, r.dst_stride_bytes}}) {
      int64_t span = 0, end = 0;
      NEREUS_CHECK(!__builtin_mul_overflow(r.num_rows - 1, stride, &span) &&
                       !__builtin_add_overflow(span, r.row_bytes, &span) &&
                       !__builtin_add_overflow(addr, span, &end),
                   "region " << i << " at " << addr << " with " << r.num_rows << " rows of "
                             << r.row_bytes << " bytes every " << stride
                             << " bytes ends past the address space");
    }
    if (r.num_rows > 1 && r.src_stride_bytes == r.row_bytes && r.dst_stride_bytes == r.row_bytes) {
      r.row_bytes *= r.num_rows;
      r.num_rows = 1;
    }
    regions.push_back(r);
  }
  prefix->assign(regions.size() + 1, 0);
  for (size_t i = 0; i < regions.size(); ++i) {
    NEREUS_CHECK(!__builtin_add_overflow((*prefix)[i], regions[i].num_rows * regions[i].row_bytes,
                                         &(*prefix)[i + 1]),
                 "the table's regions hold more than 2^63 - 1 bytes in all");
  }
  return regions;
}

int copy_num_parts(int64_t total, int num_threads) {
  if (num_threads <= 0) num_threads = copy_default_num_threads();
  const int64_t by_size = total / kCopyMinBytesPerThread;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, by_size)));
}

int copy_regions(const CopyRegion* table, int64_t num_regions, int num_threads) {
  std::vector<int64_t> prefix;
  std::vector<CopyRegion> regions = normalize_regions(table, num_regions, &prefix);
  const int64_t total = prefix.back();
  const int num_parts = copy_num_parts(total, num_threads);
  if (num_parts == 1) {
    copy_range(regions.data(), prefix, 0, total);
    return 1;
  }
  std::unique_lock<std::mutex> busy(*g_pool_mu, std::try_to_lock);
  if (!busy.owns_lock()) {
    // Another thread is using the pool; copying alone beats waiting for it.
    copy_range(regions.data(), prefix, 0, total);
    return 1;
  }
  if (g_pool == nullptr || g_pool->num_workers() < num_parts - 1) {
    delete g_pool;
    g_pool = new CopyPool(num_parts - 1);
  }
  // Part boundaries on 4 KiB of the packed stream keep two threads off one page of the
  // packed buffer.
  auto boundary = [&](int p) {
    if (p == num_parts) return total;
    return (total / num_parts * p) & ~static_cast<int64_t>(4095);
  };
  const CopyRegion* data = regions.data();
  g_pool->run(num_parts, [&](int p) { copy_range(data, prefix, boundary(p), boundary(p + 1)); });
  return num_parts;
}

}  // namespace nereus
