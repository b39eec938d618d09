// Stream exchange of region tables over connected sockets: each peer's rows are
// written with sendmsg and read with recvmsg straight from and into the tensors'
// storage (iovecs of rows), so strided pieces need no staging copy on either side.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace nereus {

// Columns of a net table row: addr, num_rows, row_bytes, stride_bytes (pack.RegionTable).
constexpr int kNetTableColumns = 4;

// sendmsg/recvmsg accept at most this many iovecs per call (IOV_MAX).
constexpr int kNetMaxIovecs = 1024;

// Runs shorter than this travel through a bounce buffer instead of as one iovec
// each: the kernel's cost per iovec outweighs a copy that stays in cache. 16 MiB as
// 768-byte rows over TCP loopback, both ends in one process (medians of runs on a
// noisy 2-core VM): 8.4-10 ms as iovecs; through a bounce buffer of 16 KiB 5.7 ms,
// 32 KiB 4.5-4.7 ms, 64 KiB 4.3-6.6 ms, 128 KiB 7.0-8.6 ms, 512 KiB 10-13 ms;
// contiguous 2.9 ms (6 ms in some runs).
constexpr int64_t kNetBounceRunBytes = 4096;
constexpr int64_t kNetBounceBytes = 64 * 1024;

// What one job of an exchange did: bytes moved of its total, the errno of its failed
// call (0: none), and whether the peer closed the stream before it was done.
struct NetJobResult {
  int64_t bytes;
  int64_t total;
  int error;
  bool eof;
};

// One exchange: jobs added, then run on threads of its own (see start()) until every
// job is done, one fails, or cancel() is called. The fds must be connected, non-blocking stream
// sockets; a send job and a receive job may share one. The tables' addresses must
// stay valid until the run has ended (wait() returned true, or cancel()).
class NetExchange {
 public:
  NetExchange();
  ~NetExchange();
  NetExchange(const NetExchange&) = delete;
  NetExchange& operator=(const NetExchange&) = delete;

  // Adds a job: the table's rows (kNetTableColumns int64 each) are written to fd in
  // order (send) or read from it in order (receive). Only before start().
  void add(int fd, bool send, const int64_t* table, int64_t num_regions);
  // Starts the run (a second call does nothing): sends and receives on a thread each,
  // so the kernel's copies of the two directions can run on two cores.
  void start();
  // Waits up to timeout_ms for the run to end; true when it has.
  bool wait(int timeout_ms);
  // Ends the run (its thread exits at its next wake) and joins it.
  void cancel();
  // Per job, in the order added; only once the run has ended.
  std::vector<NetJobResult> results() const;

 private:
  // A table row: rows of row_bytes, row r at addr + r * stride (a contiguous region
  // is one row of all its bytes).
  struct Rows {
    int64_t addr;
    int64_t rows;
    int64_t row_bytes;
    int64_t stride;
    bool short_rows() const { return row_bytes < kNetBounceRunBytes; }
  };
  struct Job {
    int fd;
    bool send;
    std::vector<Rows> regions;  // non-empty ones, in order
    // The cursor: the first byte not yet moved is byte `col` of row `row` of
    // regions[region] (region == regions.size(): all moved).
    size_t region = 0;
    int64_t row = 0;
    int64_t col = 0;
    int64_t bytes = 0;
    int64_t total = 0;
    // Bounce buffer: a send packs short rows into it and writes [bounce_at,
    // bounce_len); a receive reads bounce_len bytes into it, then scatters them.
    // bounce_len is 0 between two uses.
    std::vector<char> bounce;
    size_t bounce_len = 0;
    size_t bounce_at = 0;
    int error = 0;
    bool eof = false;
    bool done() const { return region == regions.size() && bounce_len == 0; }
    // The rest of the cursor's row.
    char* here() const {
      const Rows& r = regions[region];
      return reinterpret_cast<char*>(r.addr + row * r.stride + col);
    }
    int64_t left_in_row() const { return regions[region].row_bytes - col; }
    // Moves the cursor n bytes on (n <= left_in_row()).
    void advance(int64_t n);
  };
  // Copies short rows from the cursor between the bounce buffer and the shards (pack
  // for a send, scatter for a receive), at most bytes of them; advances the cursor.
  static size_t bounce_rows(Job& job, size_t bytes, bool pack);
  // The bytes of short rows from the cursor that fit the bounce buffer.
  static size_t short_bytes(const Job& job);

  // Runs the send jobs (send) or the receive jobs until they are done, one fails (which
  // stops the other loop too) or stop_.
  void run(bool send);
  // Sets stop_ and wakes both loops.
  void stop();
  // One sendmsg/recvmsg from the job's cursor: >0 bytes moved, 0 would block, <0 failed.
  int64_t step(Job& job);

  std::vector<Job> jobs_;
  std::vector<std::thread> threads_;
  int running_ = 0;  // loops not ended yet (under mu_)
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::condition_variable ended_cv_;
  bool ended_ = false;
  bool started_ = false;
};

}  // namespace nereus
