// The partition index of S stages on N devices built here, not marshalled from
// planner_bounds.PartitionBounds: that Python build (set partitions, maximal size
// assignments and their permutations, the index arrays) took 7-14 ms on the first
// decision at each new device count, e.g. the first one after a device loss. Same
// partitions, same rows in the same order, so the same PartitionIndex
// (tests/test_planner_native.py compares the two).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "planner/planner.h"

namespace nereus_rl::planner {

namespace {

using Partition = std::vector<std::vector<int>>;

// Port of planner_tables.set_partitions over items first..S-1, in its order.
std::vector<Partition> set_partitions(int first, int S) {
  if (first == S) return {Partition{}};
  std::vector<Partition> out;
  for (const Partition& part : set_partitions(first + 1, S)) {
    Partition alone;
    alone.reserve(part.size() + 1);
    alone.push_back({first});
    alone.insert(alone.end(), part.begin(), part.end());
    out.push_back(std::move(alone));
    for (size_t i = 0; i < part.size(); ++i) {
      Partition joined = part;
      joined[i].insert(joined[i].begin(), first);
      out.push_back(std::move(joined));
    }
  }
  return out;
}

// Port of planner_bounds._maximal_multisets: non-increasing exponent tuples with
// sum 2^j <= N that no doubling of the smallest keeps within N.
void maximal_multisets(int64_t N, int64_t cur, int left, int jmax, std::vector<int>& pref,
                       std::vector<std::vector<int>>& out) {
  if (left == 0) {
    if (cur + (int64_t(1) << pref.back()) > N) out.push_back(pref);
    return;
  }
  for (int j = jmax; j >= 0; --j) {
    const int64_t n = int64_t(1) << j;
    if (cur + n + (left - 1) > N) continue;
    if (cur + (left + 1) * n <= N) break;
    pref.push_back(j);
    maximal_multisets(N, cur + n, left - 1, j, pref, out);
    pref.pop_back();
  }
}

// Port of planner_bounds.maximal_assignments: every distinct permutation of every
// maximal multiset, sorted as Python sorts the tuples. A row of k exponents (each < 64,
// k <= 10) is packed big-endian 6 bits per exponent, so sorting the keys sorts the rows.
std::vector<uint64_t> maximal_assignments(int64_t N, int k) {
  int top = 0;
  while ((int64_t(1) << (top + 1)) <= N) ++top;
  std::vector<std::vector<int>> multisets;
  std::vector<int> pref;
  maximal_multisets(N, 0, k, top, pref, multisets);
  std::vector<uint64_t> keys;
  for (auto& ms : multisets) {
    std::sort(ms.begin(), ms.end());
    do {
      uint64_t key = 0;
      for (int j : ms) key = key << 6 | uint64_t(j);
      keys.push_back(key);
    } while (std::next_permutation(ms.begin(), ms.end()));
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

}  // namespace

PartitionIndex build_index(int S, int64_t N) {
  PartitionIndex pb;
  pb.S = S;
  pb.N = int(N);
  pb.L = 0;
  while ((int64_t(1) << pb.L) <= N) ++pb.L;        // N.bit_length()
  std::vector<std::vector<uint64_t>> by_k(S + 1);  // assignments per group count
  for (const Partition& part : set_partitions(0, S)) {
    const int k = int(part.size());
    if (k > N) continue;
    std::vector<int> masks;
    for (const auto& g : part) {
      int m = 0;
      for (int i : g) m |= 1 << i;
      masks.push_back(m);
    }
    if (by_k[k].empty()) by_k[k] = maximal_assignments(N, k);
    pb.begin.push_back(int64_t(pb.gj.size()));
    const auto& rows = by_k[k];
    for (size_t r = 0; r < rows.size(); ++r) {
      int from = 0;  // the first column that differs from the previous row (rows distinct)
      for (int c = 0; c < k; ++c) {
        const int shift = 6 * (k - 1 - c);
        const uint8_t j = uint8_t(rows[r] >> shift & 63);
        pb.gj.push_back(j);
        if (r > 0 && from == c && (rows[r - 1] >> shift & 63) == j) from = c + 1;
      }
      pb.from.push_back(uint8_t(r > 0 ? from : 0));
    }
    pb.masks.push_back(std::move(masks));
  }
  pb.begin.push_back(int64_t(pb.gj.size()));
  index_prefixes(pb);
  return pb;
}

}  // namespace nereus_rl::planner
