// dlopen of libnccl.so.2 and thin checked wrappers over its C entry points.
#include "nccl/nccl_library.h"

#include <dlfcn.h>

#include <cstring>
#include <sstream>

#include "common.h"

namespace nereus {

namespace {
nccl_abi::Comm as_comm(std::uintptr_t comm) { return reinterpret_cast<nccl_abi::Comm>(comm); }
std::uintptr_t as_int(nccl_abi::Comm comm) { return reinterpret_cast<std::uintptr_t>(comm); }

nccl_abi::UniqueId to_unique_id(const std::string& bytes) {
  NEREUS_CHECK(bytes.size() == nccl_abi::kUniqueIdBytes, "an NCCL unique id is "
                                                             << nccl_abi::kUniqueIdBytes
                                                             << " bytes, got " << bytes.size());
  nccl_abi::UniqueId id;
  std::memcpy(id.internal, bytes.data(), nccl_abi::kUniqueIdBytes);
  return id;
}
}  // namespace

NcclLibrary::NcclLibrary(const std::string& path) : path_(path) {
  // RTLD_LOCAL: a second NCCL (e.g. torch's own) in the process must not be shadowed.
  handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle_ == nullptr) {
    const char* err = dlerror();
    throw std::runtime_error("dlopen(" + path + ") failed: " + (err ? err : "unknown error"));
  }
  try {
    get_version_ = reinterpret_cast<nccl_abi::GetVersionFn>(symbol("ncclGetVersion", true));
    get_unique_id_ = reinterpret_cast<nccl_abi::GetUniqueIdFn>(symbol("ncclGetUniqueId", true));
    comm_init_rank_ = reinterpret_cast<nccl_abi::CommInitRankFn>(symbol("ncclCommInitRank", true));
    comm_split_ = reinterpret_cast<nccl_abi::CommSplitFn>(symbol("ncclCommSplit", true));
    shrink_ = reinterpret_cast<nccl_abi::CommShrinkFn>(symbol("ncclCommShrink", false));
    comm_get_unique_id_ =
        reinterpret_cast<nccl_abi::CommGetUniqueIdFn>(symbol("ncclCommGetUniqueId", false));
    grow_ = reinterpret_cast<nccl_abi::CommGrowFn>(symbol("ncclCommGrow", false));
    comm_destroy_ = reinterpret_cast<nccl_abi::CommDestroyFn>(symbol("ncclCommDestroy", true));
    comm_abort_ = reinterpret_cast<nccl_abi::CommAbortFn>(symbol("ncclCommAbort", true));
    comm_get_async_error_ =
        reinterpret_cast<nccl_abi::CommGetAsyncErrorFn>(symbol("ncclCommGetAsyncError", true));
    comm_count_ = reinterpret_cast<nccl_abi::CommCountFn>(symbol("ncclCommCount", true));
    comm_user_rank_ = reinterpret_cast<nccl_abi::CommUserRankFn>(symbol("ncclCommUserRank", true));
    group_start_ = reinterpret_cast<nccl_abi::GroupStartFn>(symbol("ncclGroupStart", true));
    group_end_ = reinterpret_cast<nccl_abi::GroupEndFn>(symbol("ncclGroupEnd", true));
    send_ = reinterpret_cast<nccl_abi::SendFn>(symbol("ncclSend", true));
    recv_ = reinterpret_cast<nccl_abi::RecvFn>(symbol("ncclRecv", true));
    get_error_string_ =
        reinterpret_cast<nccl_abi::GetErrorStringFn>(symbol("ncclGetErrorString", true));
    get_last_error_ = reinterpret_cast<nccl_abi::GetLastErrorFn>(symbol("ncclGetLastError", false));
  } catch (...) {
    dlclose(handle_);
    handle_ = nullptr;
    throw;
  }
}

NcclLibrary::~NcclLibrary() {
  // Never dlclose: communicators and NCCL's own threads may outlive this object
  // (e.g. a pool still holds them during interpreter shutdown).
}

void* NcclLibrary::symbol(const char* name, bool required) {
  void* fn = dlsym(handle_, name);
  if (fn == nullptr && required) {
    throw std::runtime_error(path_ + " has no symbol " + name +
                             ": it is not NCCL >= 2.18; point NEREUS_NCCL_PATH at a newer one");
  }
  return fn;
}

void NcclLibrary::check(nccl_abi::Result rc, const char* call, nccl_abi::Comm comm) const {
  if (rc == nccl_abi::kSuccess) return;
  std::ostringstream os;
  os << call << " failed: " << error_string(rc) << " (ncclResult_t " << rc << ")";
  if (get_last_error_ != nullptr) {
    const char* last = get_last_error_(comm);
    if (last != nullptr && last[0] != '\0') os << "; NCCL says: " << last;
  }
  throw NcclCallError(os.str(), rc);
}

std::string NcclLibrary::error_string(int code) const {
  const char* s = get_error_string_(code);
  return s ? s : "unknown NCCL error";
}

int NcclLibrary::version() const {
  int v = 0;
  check(get_version_(&v), "ncclGetVersion");
  return v;
}

std::string NcclLibrary::get_unique_id() const {
  nccl_abi::UniqueId id;
  check(get_unique_id_(&id), "ncclGetUniqueId");
  return std::string(id.internal, nccl_abi::kUniqueIdBytes);
}

std::uintptr_t NcclLibrary::comm_init_rank(int nranks, const std::string& unique_id,
                                           int rank) const {
  NEREUS_CHECK(nranks >= 1 && rank >= 0 && rank < nranks,
               "rank " << rank << " must lie in [0, " << nranks << ")");
  nccl_abi::UniqueId id = to_unique_id(unique_id);
  nccl_abi::Comm comm = nullptr;
  check(comm_init_rank_(&comm, nranks, id, rank), "ncclCommInitRank");
  return as_int(comm);
}

std::uintptr_t NcclLibrary::comm_split(std::uintptr_t comm, int color, int key) const {
  NEREUS_CHECK(comm != 0, "a live communicator");
  nccl_abi::Comm out = nullptr;
  check(comm_split_(as_comm(comm), color, key, &out, nullptr), "ncclCommSplit", as_comm(comm));
  return as_int(out);
}

std::uintptr_t NcclLibrary::comm_shrink(std::uintptr_t comm, std::vector<int> exclude_ranks,
                                        bool abort_pending) const {
  if (shrink_ == nullptr) {
    throw NcclCallError(path_ + " has no ncclCommShrink (needs NCCL >= 2.27)", 5);
  }
  NEREUS_CHECK(comm != 0, "a live communicator");
  nccl_abi::Comm out = nullptr;
  int flags = abort_pending ? nccl_abi::kShrinkAbort : nccl_abi::kShrinkDefault;
  check(shrink_(as_comm(comm), exclude_ranks.data(), static_cast<int>(exclude_ranks.size()), &out,
                nullptr, flags),
        "ncclCommShrink", as_comm(comm));
  return as_int(out);
}

std::string NcclLibrary::comm_get_unique_id(std::uintptr_t comm) const {
  if (comm_get_unique_id_ == nullptr) {
    throw NcclCallError(path_ + " has no ncclCommGetUniqueId (needs NCCL >= 2.28)", 5);
  }
  nccl_abi::UniqueId id;
  check(comm_get_unique_id_(as_comm(comm), &id), "ncclCommGetUniqueId", as_comm(comm));
  return std::string(id.internal, nccl_abi::kUniqueIdBytes);
}

std::uintptr_t NcclLibrary::comm_grow(std::uintptr_t comm, int nranks, const std::string& unique_id,
                                      int rank) const {
  if (grow_ == nullptr) {
    throw NcclCallError(path_ + " has no ncclCommGrow (needs NCCL >= 2.28)", 5);
  }
  nccl_abi::UniqueId id;
  const nccl_abi::UniqueId* id_ptr = nullptr;
  if (!unique_id.empty()) {
    id = to_unique_id(unique_id);
    id_ptr = &id;
  }
  nccl_abi::Comm out = nullptr;
  check(grow_(as_comm(comm), nranks, id_ptr, rank, &out, nullptr), "ncclCommGrow", as_comm(comm));
  return as_int(out);
}

void NcclLibrary::comm_destroy(std::uintptr_t comm) const {
  check(comm_destroy_(as_comm(comm)), "ncclCommDestroy");
}

void NcclLibrary::comm_abort(std::uintptr_t comm) const {
  check(comm_abort_(as_comm(comm)), "ncclCommAbort");
}

int NcclLibrary::comm_get_async_error(std::uintptr_t comm) const {
  nccl_abi::Result state = nccl_abi::kSuccess;
  check(comm_get_async_error_(as_comm(comm), &state), "ncclCommGetAsyncError", as_comm(comm));
  return state;
}

int NcclLibrary::comm_count(std::uintptr_t comm) const {
  int n = 0;
  check(comm_count_(as_comm(comm), &n), "ncclCommCount", as_comm(comm));
  return n;
}

int NcclLibrary::comm_user_rank(std::uintptr_t comm) const {
  int r = 0;
  check(comm_user_rank_(as_comm(comm), &r), "ncclCommUserRank", as_comm(comm));
  return r;
}

void NcclLibrary::group_send_recv(std::uintptr_t comm, const std::vector<P2pOp>& sends,
                                  const std::vector<P2pOp>& recvs, std::uintptr_t stream) const {
  NEREUS_CHECK(comm != 0, "a live communicator");
  nccl_abi::Comm c = as_comm(comm);
  auto s = reinterpret_cast<nccl_abi::Stream>(stream);
  check(group_start_(), "ncclGroupStart", c);
  // Every op is enqueued before the group is closed, even after a failure, because
  // an open group would poison the next NCCL call of this thread.
  nccl_abi::Result first_rc = nccl_abi::kSuccess;
  const char* first_call = nullptr;
  for (const P2pOp& op : sends) {
    nccl_abi::Result rc =
        send_(reinterpret_cast<const void*>(op.ptr), op.nbytes, nccl_abi::kUint8, op.peer, c, s);
    if (rc != nccl_abi::kSuccess && first_rc == nccl_abi::kSuccess) {
      first_rc = rc;
      first_call = "ncclSend";
    }
  }
  for (const P2pOp& op : recvs) {
    nccl_abi::Result rc =
        recv_(reinterpret_cast<void*>(op.ptr), op.nbytes, nccl_abi::kUint8, op.peer, c, s);
    if (rc != nccl_abi::kSuccess && first_rc == nccl_abi::kSuccess) {
      first_rc = rc;
      first_call = "ncclRecv";
    }
  }
  nccl_abi::Result end_rc = group_end_();
  if (first_rc != nccl_abi::kSuccess) check(first_rc, first_call, c);
  check(end_rc, "ncclGroupEnd", c);
}

}  // namespace nereus
