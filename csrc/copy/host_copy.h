// Multi-threaded host copy over a table of 2-D strided regions.
#pragma once

#include <cstdint>
#include <vector>

namespace nereus {

// One row of a region table: num_rows rows of row_bytes bytes; row r is read from
// src_addr + r * src_stride_bytes and written to dst_addr + r * dst_stride_bytes.
struct CopyRegion {
  int64_t src_addr;
  int64_t dst_addr;
  int64_t num_rows;
  int64_t row_bytes;
  int64_t src_stride_bytes;
  int64_t dst_stride_bytes;
};

// Columns of the int64 table that Python hands over, in CopyRegion's field order.
constexpr int kCopyTableColumns = 6;

// Below this many bytes per thread, waking a thread costs more than it saves.
constexpr int64_t kCopyMinBytesPerThread = 256 * 1024;

// Number of CPUs this process may run on (affinity mask), at least 1.
int copy_default_num_threads();

// Checks every region of the table, drops empty ones and merges regions whose rows
// follow each other on both sides into one row (so a byte split can cut them
// anywhere and the copy sees the longest runs). prefix gets the running byte count
// (size regions + 1). Shared by copy_regions and cma_read.
std::vector<CopyRegion> normalize_regions(const CopyRegion* table, int64_t num_regions,
                                          std::vector<int64_t>* prefix);

// How many parts a copy of total bytes splits into: at most num_threads (<= 0: the
// default), at least kCopyMinBytesPerThread each, at least 1.
int copy_num_parts(int64_t total, int num_threads);

// Copies every region of the table, splitting the bytes evenly over up to
// num_threads threads (the caller is one of them; <= 0 means the default). Tables
// under kCopyMinBytesPerThread * 2 bytes run on the calling thread alone. Regions must
// not overlap each other's destinations. Returns the number of threads used.
int copy_regions(const CopyRegion* regions, int64_t num_regions, int num_threads);

}  // namespace nereus
