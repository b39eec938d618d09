// The small slice of NCCL's C ABI that Nereus calls, declared here so that the
// core builds without NCCL or CUDA headers; libnccl.so.2 is dlopen'ed at run time.
// Signatures follow NCCL's nccl.h (2.18+; ncclCommShrink 2.27+, ncclCommGrow 2.28+).
#pragma once

#include <cstddef>

namespace nereus::nccl_abi {

// Opaque communicator handle (ncclComm_t).
typedef struct ncclComm* Comm;
// cudaStream_t is an opaque pointer; it crosses into Python as an integer.
typedef void* Stream;
// ncclResult_t: a C enum of non-negative values, passed as a 32-bit integer.
typedef int Result;
// ncclDataType_t, also a C enum; only ncclUint8 is used (buffers are raw bytes).
typedef int DataType;
// Opaque ncclConfig_t; always passed as nullptr (inherit / defaults).
struct Config;

constexpr int kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
// ncclUniqueId: passed by value to ncclCommInitRank, so its layout must match exactly.
struct UniqueId {
  char internal[kUniqueIdBytes];
};

constexpr Result kSuccess = 0;        // ncclSuccess
constexpr Result kInProgress = 7;     // ncclInProgress
constexpr DataType kUint8 = 1;        // ncclUint8
constexpr int kSplitNoColor = -1;     // NCCL_SPLIT_NOCOLOR
constexpr int kShrinkDefault = 0x00;  // NCCL_SHRINK_DEFAULT
constexpr int kShrinkAbort = 0x01;    // NCCL_SHRINK_ABORT

// Returns the NCCL version code (e.g. 23203 for 2.32.3).
typedef Result (*GetVersionFn)(int* version);
// Generates the id that every rank of a new communicator passes to ncclCommInitRank.
typedef Result (*GetUniqueIdFn)(UniqueId* unique_id);
// Creates one rank of a communicator of nranks ranks (blocks until all ranks join).
typedef Result (*CommInitRankFn)(Comm* comm, int nranks, UniqueId comm_id, int rank);
// Creates sub-communicators: ranks with the same color share one, ordered by key.
typedef Result (*CommSplitFn)(Comm comm, int color, int key, Comm* newcomm, Config* config);
// Removes the listed ranks; the remaining ranks are renumbered densely.
typedef Result (*CommShrinkFn)(Comm comm, int* exclude_ranks, int exclude_count, Comm* newcomm,
                               Config* config, int shrink_flags);
// Per-communicator id that the root of a grow hands to the joining ranks.
typedef Result (*CommGetUniqueIdFn)(Comm comm, UniqueId* unique_id);
// Adds ranks: existing ranks pass comm and rank -1 (root also the id); new ranks pass
// comm nullptr, the id and their assigned rank.
typedef Result (*CommGrowFn)(Comm comm, int nranks, const UniqueId* unique_id, int rank,
                             Comm* newcomm, Config* config);
// Frees a communicator after its work is done.
typedef Result (*CommDestroyFn)(Comm comm);
// Frees a communicator and aborts its pending operations.
typedef Result (*CommAbortFn)(Comm comm);
// Reports an asynchronous error (e.g. a failed peer) of a communicator.
typedef Result (*CommGetAsyncErrorFn)(Comm comm, Result* async_error);
// Number of ranks, and this process's rank, in a communicator.
typedef Result (*CommCountFn)(Comm comm, int* count);
typedef Result (*CommUserRankFn)(Comm comm, int* rank);
// Opens / closes a group: the sends and receives between them are issued as one.
typedef Result (*GroupStartFn)();
typedef Result (*GroupEndFn)();
// Point-to-point transfers of count elements of datatype on stream.
typedef Result (*SendFn)(const void* buf, size_t count, DataType datatype, int peer, Comm comm,
                         Stream stream);
typedef Result (*RecvFn)(void* buf, size_t count, DataType datatype, int peer, Comm comm,
                         Stream stream);
// Human-readable text of a result code, and the last error message (2.13+, optional).
typedef const char* (*GetErrorStringFn)(Result result);
typedef const char* (*GetLastErrorFn)(Comm comm);

}  // namespace nereus::nccl_abi
