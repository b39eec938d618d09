// torch.chunk's split of a dim, shared by the dp x tp x pp planner and the sharded one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace nereus::remap {

// Chunk `index` of `n` elements cut into `parts` as torch.chunk cuts them: chunk =
// ceil(n / parts); trailing chunks may be short or empty. [start, stop), with no
// intermediate overflow for any n >= 0, parts >= 1, index >= 0.
inline std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t parts, int64_t index) {
  if (n <= 0) return {0, 0};
  const int64_t size = n / parts + (n % parts != 0);
  const int64_t start = index > n / size ? n : std::min(index * size, n);
  return {start, start + std::min(size, n - start)};
}

}  // namespace nereus::remap
