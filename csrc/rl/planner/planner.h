// Compiled search of the exact planner (nereus_rl/planner.py has the design; the Python
// modules planner_search.py, planner_groups.py and planner_bounds.py are the reference
// this code follows step by step).
//
// The result must be identical to the Python search: same plans, same objectives (bit
// for bit), same k-best order and tie-breaks. So every floating-point sum here is taken
// in the order the Python code takes it, every sort is stable with the same key, and the
// k-best heap replays heapq's exact sift order.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

namespace nereus_rl::planner {

// An allocator whose resize() leaves new doubles uninitialized (for arrays filled whole
// right after, on every new context).
template <class T>
struct NoInit : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = NoInit<U>;
  };
  template <class U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

// One entry of a stage's Pareto list: a layout's time, memory, index and devices.
struct Cand {
  double t;
  int64_t mem;
  int32_t li;
  int32_t d;
};
using List = std::vector<Cand>;

// Pareto lists F_s(2^j) of one stage (one sync variant for rollout) for every size
// 2^j <= max_n, sorted by time with memory falling, and the fastest time at each size
// (+inf where nothing fits).
struct Fronts {
  std::vector<List> by_j;
  std::vector<double> fast;
};

// A stage table's layouts: memory and devices per layout (table order), and what does
// not depend on the efficiencies, built once per table: the layouts of each size 2^j,
// sorted by (memory, layout index), are order[at[j] .. at[j + 1]).
struct Layouts {
  std::vector<int64_t> mem, d;
  std::vector<int32_t> order, at;
  Layouts(std::vector<int64_t> mem, std::vector<int64_t> d);  // d: powers of two
};

// Port of Planner._pareto_lists: t per layout (table order).
Fronts build_fronts(const double* t, const Layouts& lay, int64_t cap, int64_t max_n);

// One Pareto phase vector of a colocation group and the layout index of each stage.
struct GroupVec {
  double v[3];
  std::vector<int32_t> choices;
};

// Port of planner_groups.group_vectors.
std::vector<GroupVec> group_vectors(const std::vector<const List*>& lists,
                                    const std::vector<int>& phases, int64_t thr, int64_t cap);

// Port of planner_search.LastGroup: what the last group's depth-first search needs.
struct LastGroup {
  std::vector<const List*> lists;
  std::vector<int> phases;
  int64_t thr = 0, cap = 0;
  std::vector<std::array<double, 3>> rmin;
  std::vector<int64_t> rmem;
  std::vector<char> rflag;
  LastGroup(std::vector<const List*> lists, std::vector<int> phases, int64_t thr, int64_t cap);
};

// Set partitions of the stages with their maximal size assignments on N devices (the
// index arrays of planner_bounds.PartitionBounds, marshalled once per (S, N)).
struct PartitionIndex {
  int S = 0, N = 0, L = 0;
  std::vector<std::vector<int>> masks;  // per partition, its groups as stage bitmasks
  // Rows of every partition (one per maximal size assignment), k = its number of groups
  // entries each: the size exponent of each group (bytes: the bounds stream through
  // these thousands of entries on every call that needs them, so they are kept small).
  // Partition o's rows start at entry begin[o] and end at begin[o + 1].
  std::vector<uint8_t> gj;
  std::vector<int64_t> begin;
  // Per row, its first column whose size differs from the previous row's (rows of a
  // partition are sorted, so maxima over the columns before it carry over); 0 for the
  // first row of each partition.
  std::vector<uint8_t> from;
  // Per entry (row r, column c): the next row of the partition whose first c + 1
  // columns differ from row r's (or the partition's end): the rows sharing a prefix are
  // contiguous, so a prefix that cannot beat the bound is skipped whole.
  std::vector<int32_t> skip;
  std::vector<int32_t> row0;  // per partition, the index of its first row
};

// Fills pb.skip and pb.row0 from pb.masks, pb.begin and pb.from.
void index_prefixes(PartitionIndex& pb);

// The index of every set partition of S stages (at most N groups) with its maximal
// power-of-two size assignments on N devices, built directly (index.cpp): the same as
// marshalling planner_bounds.PartitionBounds(S, N).
PartitionIndex build_index(int S, int64_t N);

// A plan found by the search: objective and, per group in search order, its stage
// bitmask and the layout index of each of its stages.
struct Found {
  double obj;
  std::vector<std::pair<int, std::vector<int32_t>>> picks;
};

struct SearchOut {
  std::vector<Found> ranked;  // best first; empty: nothing fits
  int64_t nodes = 0, partitions = 0;
  double bounds_ms = 0, search_ms = 0;
};

// Everything the search needs for one (stage shapes, efficiencies, capacity): the
// stages' Pareto lists, the cheap bounds of every stage subset, and caches of group
// tables, last-group data and partition bounds (per device count) across calls.
class Context {
 public:
  // fronts: per stage (the rollout's slot holds its intra-node sync variant);
  // rollout_inter: the rollout's inter-node variant (unused when r_i < 0).
  Context(std::vector<Fronts> fronts, Fronts rollout_inter, std::vector<int> phases, int r_i,
          int a_i, int64_t cap, int64_t dpn, bool one_node);

  SearchOut search(const PartitionIndex& pb, int k);
  // (order of the partitions to search, every partition's bound) on pb.N devices.
  const std::pair<std::vector<int64_t>, std::vector<double>>& bounds(const PartitionIndex& pb);
  // Lazily refined partition bounds on pb.N devices: key[o] <= partition o's bound,
  // equal to it where exact[o] (see search.cpp). Kept across calls, like bounds().
  struct Lazy {
    std::vector<double> key;
    std::vector<uint8_t> exact;
    // The search's min-heap of (key, exact, partition) over the partitions with a finite
    // key, kept between calls (search.cpp): a call re-adds the few it took out instead
    // of rebuilding it over every partition.
    struct Item {
      double key;
      uint8_t exact;
      int32_t o;
    };
    std::vector<Item> heap;
    bool heaped = false;
  };
  Lazy& lazy(const PartitionIndex& pb);
  // Partition o's bound if it is at most `cutoff` (*exact = true); otherwise a lower
  // bound of it above `cutoff` (*exact = false).
  double refine(const PartitionIndex& pb, size_t o, double cutoff, bool* exact) const;
  const std::vector<double, NoInit<double>>& cheap() const { return C_; }
  int num_sizes() const { return L_; }
  int num_stages() const { return S_; }

  // Internals shared with the search (search.cpp).
  struct GroupTable {
    std::vector<GroupVec> vecs;
    bool stop;
  };
  struct LastInfo {
    std::unique_ptr<LastGroup> lg;
    int64_t nxt;
  };
  const GroupTable& group_table(int mask, int64_t n);
  const LastInfo& last_info(int mask, int64_t n);
  const double* cheap_row(int mask, int j) const { return &C_[(size_t(mask) * L_ + j) * 3]; }

 private:
  std::vector<const List*> lists_of(int mask, int64_t n, int64_t* thr, bool* both) const;

  std::vector<Fronts> fronts_;
  Fronts rinter_;
  std::vector<int> phases_;
  int S_, r_i_, a_i_, L_;
  int64_t cap_, dpn_;
  bool one_node_;
  // (2^S, L, 3) cheap bounds, shaved (every entry is written: not zeroed first).
  std::vector<double, NoInit<double>> C_;
  std::map<std::pair<int, int64_t>, GroupTable> groups_;
  std::map<std::pair<int, int64_t>, LastInfo> lasts_;
  std::map<int, std::pair<std::vector<int64_t>, std::vector<double>>> bounds_;
  std::map<int, Lazy> lazy_;
};

}  // namespace nereus_rl::planner
