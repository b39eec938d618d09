// Page remapping: move a range's bytes to another address of this process without
// copying them (the kernel moves page-table entries).
#pragma once

#include <cstdint>

namespace nereus {

// One row of a swap table: exchange the pages of [a, a + nbytes) and [b, b + nbytes).
struct SwapRow {
  int64_t a;
  int64_t b;
  int64_t nbytes;
};

// Columns of the int64 table that Python hands over, in SwapRow's field order.
constexpr int kSwapTableColumns = 3;

// What swap_pages did: rows swapped (a prefix of the table), and the errno of the
// row that failed (0: none failed).
struct SwapResult {
  int64_t rows;
  int error;
};

// Swaps the pages of every row, in order, with three mremap calls per row (b's pages
// to a scratch range, a's to b, the scratch's to a; MREMAP_DONTUNMAP keeps a and b
// mapped throughout, so no other thread can map anything into them; the scratch range
// sits at b's offset within a 2 MiB page, so huge pages move whole where a and b agree
// modulo 2 MiB). Each range must be page-aligned, lie inside one private anonymous
// mapping, and not overlap the other. Stops at the first row that fails, with both of
// that row's ranges mapped and holding their own pages again (except that a failed
// last step leaves a mapped but empty: its bytes are already at b). Swapping a row
// twice restores it.
SwapResult swap_pages(const SwapRow* rows, int64_t num_rows);

}  // namespace nereus
