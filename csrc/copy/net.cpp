// Stream exchange over sockets: one poll loop per exchange moves every peer's rows in
// both directions with scatter/gather calls, so the kernel copies straight between
// the tensors and the socket buffers (as it does for a contiguous buffer).
#include "copy/net.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>

#include "common.h"

namespace nereus {
namespace {

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

NetExchange::NetExchange() {
  NEREUS_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0,
               "could not make the exchange's wake pipe (errno " << errno << ")");
}

NetExchange::~NetExchange() {
  cancel();
  close_fd(wake_[0]);
  close_fd(wake_[1]);
}

void NetExchange::add(int fd, bool send, const int64_t* table, int64_t num_regions) {
  NEREUS_CHECK(!started_, "jobs are added before start()");
  NEREUS_CHECK(fd >= 0, "fd=" << fd << "; pass a connected socket's descriptor");
  NEREUS_CHECK(num_regions >= 0, "num_regions=" << num_regions);
  Job job;
  job.fd = fd;
  job.send = send;
  job.regions.reserve(static_cast<size_t>(num_regions));
  for (int64_t i = 0; i < num_regions; ++i) {
    const int64_t* r = table + i * kNetTableColumns;
    const int64_t addr = r[0], rows = r[1], row_bytes = r[2], stride = r[3];
    NEREUS_CHECK(rows >= 0 && row_bytes >= 0 && (rows <= 1 || stride >= row_bytes),
                 "net table row " << i << ": num_rows=" << rows << " row_bytes=" << row_bytes
                                  << " stride=" << stride
                                  << "; rows must not overlap and sizes must be >= 0");
    if (rows == 0 || row_bytes == 0) continue;
    int64_t span = 0, end = 0, nbytes = 0;
    NEREUS_CHECK(addr > 0 && !__builtin_mul_overflow(rows - 1, stride, &span) &&
                     !__builtin_add_overflow(addr, span, &end) &&
                     !__builtin_add_overflow(end, row_bytes, &end) &&
                     !__builtin_mul_overflow(rows, row_bytes, &nbytes),
                 "net table row " << i << " needs a positive address and an end that fits");
    // A contiguous region is one row: the longest runs, the fewest iovecs.
    if (rows == 1 || stride == row_bytes)
      job.regions.push_back({addr, 1, nbytes, nbytes});
    else
      job.regions.push_back({addr, rows, row_bytes, stride});
    job.total += nbytes;
  }
  jobs_.push_back(std::move(job));
}

void NetExchange::Job::advance(int64_t n) {
  col += n;
  if (col < regions[region].row_bytes) return;
  col = 0;
  if (++row < regions[region].rows) return;
  row = 0;
  ++region;
}

void NetExchange::start() {
  if (started_) return;
  started_ = true;
  running_ = 2;
  for (bool send : {true, false}) threads_.emplace_back([this, send] { run(send); });
}

bool NetExchange::wait(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!started_) return true;
  return ended_cv_.wait_for(lock, std::chrono::milliseconds(std::max(timeout_ms, 0)),
                            [this] { return ended_; });
}

void NetExchange::stop() {
  stop_.store(true);
  char byte = 1;
  // A full pipe already holds a wake-up: each loop sees stop_ at its next wake.
  ssize_t ignored = ::write(wake_[1], &byte, 1);
  (void)ignored;
}

void NetExchange::cancel() {
  if (threads_.empty()) return;
  stop();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

std::vector<NetJobResult> NetExchange::results() const {
  std::lock_guard<std::mutex> lock(mu_);
  // The run's thread writes the jobs without a lock: read them once it has ended.
  NEREUS_CHECK(ended_ || !started_, "results() are read after wait() returned true or cancel()");
  std::vector<NetJobResult> out;
  out.reserve(jobs_.size());
  for (const Job& j : jobs_) out.push_back({j.bytes, j.total, j.error, j.eof});
  return out;
}

size_t NetExchange::bounce_rows(Job& job, size_t bytes, bool pack) {
  size_t pos = 0;
  while (pos < bytes && job.region < job.regions.size() && job.regions[job.region].short_rows()) {
    const auto n = static_cast<size_t>(
        std::min<int64_t>(job.left_in_row(), static_cast<int64_t>(bytes - pos)));
    if (pack)
      std::memcpy(job.bounce.data() + pos, job.here(), n);
    else
      std::memcpy(job.here(), job.bounce.data() + pos, n);
    pos += n;
    job.advance(static_cast<int64_t>(n));
  }
  return pos;
}

size_t NetExchange::short_bytes(const Job& job) {
  int64_t bytes = 0;
  size_t region = job.region;
  int64_t row = job.row, col = job.col;
  while (bytes < kNetBounceBytes && region < job.regions.size() &&
         job.regions[region].short_rows()) {
    const Rows& r = job.regions[region];
    bytes += (r.rows - row) * r.row_bytes - col;  // the rest of this region
    ++region;
    row = col = 0;
  }
  return static_cast<size_t>(std::min(bytes, kNetBounceBytes));
}

int64_t NetExchange::step(Job& job) {
  if (job.bounce_len == 0 && job.regions[job.region].short_rows()) {
    // Short rows from here go through the bounce buffer: packed now for a send; a
    // receive reads that many bytes into it and scatters them once they are all in.
    if (job.bounce.empty()) job.bounce.resize(kNetBounceBytes);
    job.bounce_len = job.send ? bounce_rows(job, kNetBounceBytes, true) : short_bytes(job);
    job.bounce_at = 0;
  }
  iovec iov[kNetMaxIovecs];
  msghdr msg{};
  msg.msg_iov = iov;
  if (job.bounce_len > 0) {
    iov[0] = {job.bounce.data() + job.bounce_at, job.bounce_len - job.bounce_at};
    msg.msg_iovlen = 1;
  } else {
    // Long rows straight from or into the shards, up to the next short region.
    size_t count = 0;
    size_t region = job.region;
    int64_t row = job.row, col = job.col;
    while (count < static_cast<size_t>(kNetMaxIovecs) && region < job.regions.size() &&
           !job.regions[region].short_rows()) {
      const Rows& r = job.regions[region];
      iov[count++] = {reinterpret_cast<char*>(r.addr + row * r.stride + col),
                      static_cast<size_t>(r.row_bytes - col)};
      col = 0;
      if (++row == r.rows) {
        row = 0;
        ++region;
      }
    }
    msg.msg_iovlen = count;
  }
  ssize_t got;
  do {
    got = job.send ? ::sendmsg(job.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                   : ::recvmsg(job.fd, &msg, MSG_DONTWAIT);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    job.error = errno;
    return -1;
  }
  if (got == 0) {  // only a receive returns 0: the peer closed its end
    job.eof = true;
    return -1;
  }
  job.bytes += got;
  if (job.bounce_len > 0) {
    job.bounce_at += static_cast<size_t>(got);
    if (job.bounce_at == job.bounce_len) {
      if (!job.send) bounce_rows(job, job.bounce_len, false);
      job.bounce_len = job.bounce_at = 0;
    }
    return got;
  }
  for (int64_t left = got; left > 0;) {
    const int64_t n = std::min(left, job.left_in_row());
    job.advance(n);
    left -= n;
  }
  return got;
}

void NetExchange::run(bool send) {
  std::vector<Job*> mine;
  for (Job& job : jobs_)
    if (job.send == send) mine.push_back(&job);
  std::vector<pollfd> fds;
  Job* first_pending = nullptr;
  bool failed = false;
  while (!failed && !stop_.load()) {
    bool progressed = false, pending = false;
    for (Job* job : mine) {
      if (job->done()) continue;
      const int64_t got = step(*job);
      if (got < 0) {
        failed = true;
        break;
      }
      progressed |= got > 0;
      pending |= !job->done();
    }
    if (failed || !pending) break;
    if (progressed) continue;
    // Every pending job would block: sleep until one of them can move, or a wake-up.
    fds.clear();
    first_pending = nullptr;
    for (Job* job : mine) {
      if (job->done()) continue;
      fds.push_back({job->fd, static_cast<short>(send ? POLLOUT : POLLIN), 0});
      if (first_pending == nullptr) first_pending = job;
    }
    fds.push_back({wake_[0], POLLIN, 0});
    int ready;
    do {
      ready = ::poll(fds.data(), fds.size(), -1);
    } while (ready < 0 && errno == EINTR);
    if (ready < 0) {
      first_pending->error = errno;
      failed = true;
    }
    // POLLERR/POLLHUP: the next step of that job returns the error or the end.
  }
  // The exchange cannot complete: the other loop stops too (its peer may wait on us).
  if (failed) stop();
  std::lock_guard<std::mutex> lock(mu_);
  if (--running_ == 0) {
    ended_ = true;
    ended_cv_.notify_all();
  }
}

}  // namespace nereus
