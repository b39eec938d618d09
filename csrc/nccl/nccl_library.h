// NcclLibrary: one dlopen'ed libnccl.so.2 and the entry points Nereus calls.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nccl/nccl_abi.h"

namespace nereus {

// Raised when an NCCL call returns an error; the message carries NCCL's own text.
class NcclCallError : public std::runtime_error {
 public:
  NcclCallError(const std::string& msg, int code) : std::runtime_error(msg), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// One transfer of a grouped send/recv: (peer rank in the communicator, device pointer, bytes).
struct P2pOp {
  int peer;
  std::uintptr_t ptr;
  std::size_t nbytes;
};

class NcclLibrary {
 public:
  // Opens the library at path; throws std::runtime_error with dlerror() text on failure.
  explicit NcclLibrary(const std::string& path);
  ~NcclLibrary();
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const std::string& path() const { return path_; }
  // NCCL version code, e.g. 23203 for 2.32.3.
  int version() const;
  bool has_shrink() const { return shrink_ != nullptr; }
  bool has_grow() const { return grow_ != nullptr && comm_get_unique_id_ != nullptr; }

  std::string get_unique_id() const;
  std::uintptr_t comm_init_rank(int nranks, const std::string& unique_id, int rank) const;
  // Returns 0 when color is NCCL_SPLIT_NOCOLOR (the rank joins no communicator).
  std::uintptr_t comm_split(std::uintptr_t comm, int color, int key) const;
  std::uintptr_t comm_shrink(std::uintptr_t comm, std::vector<int> exclude_ranks,
                             bool abort_pending) const;
  std::string comm_get_unique_id(std::uintptr_t comm) const;
  // unique_id empty = pass nullptr (existing non-root ranks).
  std::uintptr_t comm_grow(std::uintptr_t comm, int nranks, const std::string& unique_id,
                           int rank) const;
  void comm_destroy(std::uintptr_t comm) const;
  void comm_abort(std::uintptr_t comm) const;
  // ncclResult_t of the communicator's asynchronous state (0 = fine, 7 = in progress).
  int comm_get_async_error(std::uintptr_t comm) const;
  int comm_count(std::uintptr_t comm) const;
  int comm_user_rank(std::uintptr_t comm) const;
  // All sends and receives inside one ncclGroupStart/End on stream (bytes as ncclUint8).
  void group_send_recv(std::uintptr_t comm, const std::vector<P2pOp>& sends,
                       const std::vector<P2pOp>& recvs, std::uintptr_t stream) const;
  std::string error_string(int code) const;

 private:
  void* symbol(const char* name, bool required);
  void check(nccl_abi::Result rc, const char* call, nccl_abi::Comm comm = nullptr) const;

  std::string path_;
  void* handle_ = nullptr;
  nccl_abi::GetVersionFn get_version_ = nullptr;
  nccl_abi::GetUniqueIdFn get_unique_id_ = nullptr;
  nccl_abi::CommInitRankFn comm_init_rank_ = nullptr;
  nccl_abi::CommSplitFn comm_split_ = nullptr;
  nccl_abi::CommShrinkFn shrink_ = nullptr;
  nccl_abi::CommGetUniqueIdFn comm_get_unique_id_ = nullptr;
  nccl_abi::CommGrowFn grow_ = nullptr;
  nccl_abi::CommDestroyFn comm_destroy_ = nullptr;
  nccl_abi::CommAbortFn comm_abort_ = nullptr;
  nccl_abi::CommGetAsyncErrorFn comm_get_async_error_ = nullptr;
  nccl_abi::CommCountFn comm_count_ = nullptr;
  nccl_abi::CommUserRankFn comm_user_rank_ = nullptr;
  nccl_abi::GroupStartFn group_start_ = nullptr;
  nccl_abi::GroupEndFn group_end_ = nullptr;
  nccl_abi::SendFn send_ = nullptr;
  nccl_abi::RecvFn recv_ = nullptr;
  nccl_abi::GetErrorStringFn get_error_string_ = nullptr;
  nccl_abi::GetLastErrorFn get_last_error_ = nullptr;
};

}  // namespace nereus
