// Sharded planner (see sharded.h for the model).
#include "remap/sharded.h"

#include <algorithm>
#include <map>
#include <unordered_set>
#include <utility>

#include "common.h"
#include "remap/chunk.h"

namespace nereus::sharded {
namespace {

using remap::chunk_range;

// Bounds the work (and so the memory) of one plan() call, whatever the input: every
// range a shard op makes, run it visits or keeps, and source box it visits costs a
// step. A plan of millions of pieces takes a small share of it; a StridedShard with
// a huge split factor, or a mesh of thousands of dims, runs out of it.
class Budget {
 public:
  static constexpr int64_t kMaxSteps = int64_t{1} << 25;
  // Holders compared while choosing senders: time only, no memory, so a larger bound
  // (a source replicated over thousands of ranks feeding thousands of receivers).
  static constexpr int64_t kMaxHolderScans = int64_t{1} << 33;
  void spend(int64_t steps, int64_t tensor) {
    NEREUS_CHECK(steps <= kMaxSteps - used_, "tensor #" << tensor << ": the shardings cut it too "
                                                        << "finely to plan (more than " << kMaxSteps
                                                        << " steps)");
    used_ += steps;
  }
  void scan(int64_t holders, int64_t tensor) {
    NEREUS_CHECK(holders <= kMaxHolderScans - scanned_,
                 "tensor #" << tensor << ": more than " << kMaxHolderScans
                            << " holder comparisons; plan fewer tensors at a time");
    scanned_ += holders;
  }

 private:
  int64_t used_ = 0, scanned_ = 0;
};

int64_t add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  NEREUS_CHECK(!__builtin_add_overflow(a, b, &out), what << " past 2^63 - 1");
  return out;
}

int64_t mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  NEREUS_CHECK(!__builtin_mul_overflow(a, b, &out), what << " past 2^63 - 1");
  return out;
}

// A global run [start, stop) of one tensor dim that starts at `origin` in the local dim.
struct Interval {
  int64_t start, stop, origin;
};

// One shard op on a tensor dim: the mesh dim, its size, and the split factor (0: Shard).
struct Op {
  int64_t mesh_dim, parts, split_factor;
};

// Where one sharding's values lie in the input arrays.
struct View {
  int64_t mesh_begin = 0, mesh_ndim = 0;  // mesh_shape / kind / dim / split_factor
  int64_t rank_begin = 0, size = 0;       // ranks / nodes
  int64_t order_begin = 0, order_end = 0;
};

std::vector<View> check_input(const ShardedInput& in) {
  const size_t n = in.tensor_ndim.size();
  NEREUS_CHECK(
      in.tensor_elem_size.size() == n && in.tensor_src.size() == n && in.tensor_dst.size() == n,
      "one element size, source and destination sharding per tensor (" << n << " tensors)");
  const int64_t num_shardings = static_cast<int64_t>(in.mesh_ndim.size());
  int64_t dims = 0;
  for (size_t t = 0; t < n; ++t) {
    NEREUS_CHECK(in.tensor_ndim[t] >= 0, "tensor #" << t << ": negative number of dims");
    dims = add(dims, in.tensor_ndim[t], "the tensors' dims");
    NEREUS_CHECK(dims <= static_cast<int64_t>(in.tensor_shape.size()),
                 "tensor #" << t << ": tensor_shape holds fewer sizes than tensor_ndim counts");
    NEREUS_CHECK(in.tensor_elem_size[t] >= 1, "tensor #" << t << ": element size below 1");
    NEREUS_CHECK(in.tensor_src[t] >= 0 && in.tensor_src[t] < num_shardings &&
                     in.tensor_dst[t] >= 0 && in.tensor_dst[t] < num_shardings,
                 "tensor #" << t << ": sharding index out of range [0, " << num_shardings << ")");
  }
  NEREUS_CHECK(
      dims == static_cast<int64_t>(in.tensor_shape.size()),
      "tensor_shape holds " << in.tensor_shape.size() << " sizes, tensor_ndim counts " << dims);
  for (int64_t s : in.tensor_shape) NEREUS_CHECK(s >= 0, "negative tensor size " << s);

  const int64_t mesh_values = static_cast<int64_t>(in.mesh_shape.size());
  const int64_t rank_values = static_cast<int64_t>(in.ranks.size());
  const int64_t order_values = static_cast<int64_t>(in.order.size());
  NEREUS_CHECK(static_cast<int64_t>(in.kind.size()) == mesh_values &&
                   static_cast<int64_t>(in.dim.size()) == mesh_values &&
                   static_cast<int64_t>(in.split_factor.size()) == mesh_values,
               "mesh_shape, kind, dim and split_factor need one entry per mesh dim");
  NEREUS_CHECK(static_cast<int64_t>(in.nodes.size()) == rank_values,
               "ranks and nodes need one entry per mesh entry");
  NEREUS_CHECK(rank_values < (int64_t{1} << 31), "at most 2^31 - 1 mesh entries");
  NEREUS_CHECK(static_cast<int64_t>(in.order_offset.size()) == num_shardings + 1,
               "order_offset needs one entry per sharding and one more");
  NEREUS_CHECK(in.order_offset[0] == 0 && in.order_offset[num_shardings] == order_values,
               "order_offset must start at 0 and end at the length of order");

  std::vector<View> views(num_shardings);
  int64_t mesh_at = 0, rank_at = 0;
  std::vector<int64_t> sorted;
  for (int64_t s = 0; s < num_shardings; ++s) {
    View& v = views[s];
    NEREUS_CHECK(in.mesh_ndim[s] >= 0 && in.mesh_ndim[s] <= mesh_values - mesh_at,
                 "sharding " << s << ": mesh_ndim out of range");
    v.mesh_begin = mesh_at;
    v.mesh_ndim = in.mesh_ndim[s];
    mesh_at += v.mesh_ndim;
    int64_t size = 1;
    for (int64_t m = 0; m < v.mesh_ndim; ++m) {
      const int64_t i = v.mesh_begin + m;
      NEREUS_CHECK(in.mesh_shape[i] >= 1, "sharding " << s << ": mesh size below 1");
      NEREUS_CHECK(!__builtin_mul_overflow(size, in.mesh_shape[i], &size) && size <= rank_values,
                   "sharding " << s << ": the mesh has more entries than ranks holds");
      const int64_t k = in.kind[i];
      NEREUS_CHECK(k == kReplicate || k == kShard || k == kStridedShard,
                   "sharding " << s << ": unknown placement kind " << k);
      NEREUS_CHECK(k == kReplicate || in.dim[i] >= 0,
                   "sharding " << s << ": negative tensor dim " << in.dim[i]);
      NEREUS_CHECK(k != kStridedShard || in.split_factor[i] >= 1,
                   "sharding " << s << ": split factor below 1");
    }
    NEREUS_CHECK(size <= rank_values - rank_at,
                 "sharding " << s << ": the mesh has more entries than ranks holds");
    v.rank_begin = rank_at;
    v.size = size;
    rank_at += size;
    sorted.assign(in.ranks.begin() + v.rank_begin, in.ranks.begin() + v.rank_begin + size);
    std::sort(sorted.begin(), sorted.end());
    NEREUS_CHECK(sorted.empty() || sorted.front() >= 0, "sharding " << s << ": negative rank");
    NEREUS_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                 "sharding " << s << ": repeated rank");

    v.order_begin = in.order_offset[s];
    v.order_end = in.order_offset[s + 1];
    NEREUS_CHECK(v.order_begin <= v.order_end, "order_offset must not decrease");
    for (int64_t at = v.order_begin; at < v.order_end;) {
      NEREUS_CHECK(v.order_end - at >= 2, "sharding " << s << ": a shard_order group is cut off");
      const int64_t d = in.order[at], count = in.order[at + 1];
      NEREUS_CHECK(d >= 0 && count >= 0 && count <= v.order_end - at - 2,
                   "sharding " << s << ": malformed shard_order group");
      for (int64_t j = 0; j < count; ++j) {
        const int64_t m = in.order[at + 2 + j];
        NEREUS_CHECK(m >= 0 && m < v.mesh_ndim,
                     "sharding " << s << ": shard_order names mesh dim " << m);
        const int64_t i = v.mesh_begin + m;
        NEREUS_CHECK(in.kind[i] != kReplicate && in.dim[i] == d,
                     "sharding " << s << ": shard_order puts mesh dim " << m << " on tensor dim "
                                 << d << ", which its placement does not shard");
      }
      at += 2 + count;
    }
  }
  NEREUS_CHECK(mesh_at == mesh_values, "mesh_shape holds more sizes than mesh_ndim counts");
  NEREUS_CHECK(rank_at == rank_values, "ranks holds more entries than the meshes have");
  return views;
}

// The shard ops of every tensor dim of an ndim-dim tensor under sharding v.
std::vector<std::vector<Op>> resolve_ops(const ShardedInput& in, const View& v, int64_t ndim,
                                         int64_t tensor, Budget* budget) {
  budget->spend(1 + ndim + v.mesh_ndim + (v.order_end - v.order_begin), tensor);
  std::vector<std::vector<Op>> ops(ndim);
  for (int64_t m = 0; m < v.mesh_ndim; ++m) {
    const int64_t i = v.mesh_begin + m;
    NEREUS_CHECK(in.kind[i] == kReplicate || in.dim[i] < ndim,
                 "tensor #" << tensor << ": mesh dim " << m << " shards dim " << in.dim[i]
                            << ", but the tensor has " << ndim << " dims");
  }
  std::map<int64_t, std::pair<int64_t, int64_t>> groups;  // tensor dim -> (at, count)
  for (int64_t at = v.order_begin; at < v.order_end; at += 2 + in.order[at + 1])
    groups[in.order[at]] = {at + 2, in.order[at + 1]};
  auto op = [&](int64_t m) {
    const int64_t i = v.mesh_begin + m;
    return Op{m, in.mesh_shape[i], in.kind[i] == kStridedShard ? in.split_factor[i] : 0};
  };
  for (int64_t m = 0; m < v.mesh_ndim; ++m) {
    const int64_t i = v.mesh_begin + m;
    if (in.kind[i] != kReplicate && groups.count(in.dim[i]) == 0) ops[in.dim[i]].push_back(op(m));
  }
  for (const auto& [d, group] : groups)
    for (int64_t j = 0; j < group.second; ++j) ops[d].push_back(op(in.order[group.first + j]));
  return ops;
}

// Computes the global intervals (in local order, adjacent ones merged, with their
// local origins) a rank at mesh coordinates `coords` holds of a dim of `length`.
class DimCutter {
 public:
  explicit DimCutter(Budget* budget) : budget_(budget) {}
  void cut(int64_t length, const std::vector<Op>& ops, const std::vector<int64_t>& coords,
           int64_t tensor, std::vector<Interval>* out) {
    iv_.clear();
    if (length > 0) iv_.push_back({0, length, 0});
    for (const Op& op : ops) {
      int64_t n = 0;
      for (const Interval& x : iv_) n += x.stop - x.start;  // disjoint runs of [0, length)
      const int64_t c = coords[op.mesh_dim];
      ranges_.clear();
      if (op.split_factor == 0) {
        ranges_.push_back(chunk_range(n, op.parts, c));
      } else if (n > 0) {
        const int64_t size = n / op.split_factor + (n % op.split_factor != 0);
        const int64_t pieces = n / size + (n % size != 0);  // the non-empty ones
        budget_->spend(pieces, tensor);
        for (int64_t j = 0; j < pieces; ++j) {
          const auto [fa, fb] = chunk_range(n, op.split_factor, j);
          const auto [a, b] = chunk_range(fb - fa, op.parts, c);
          ranges_.push_back({fa + a, fa + b});
        }
      }
      select(tensor);
    }
    int64_t at = 0;
    for (Interval& x : iv_) {
      x.origin = at;
      at += x.stop - x.start;
    }
    out->swap(iv_);
  }

 private:
  // iv_ <- the global runs of local ranges ranges_ (ascending, disjoint) of iv_.
  void select(int64_t tensor) {
    next_.clear();
    size_t k = 0;
    int64_t at = 0;  // local start of iv_[k]
    for (const auto& [lo, hi] : ranges_) {
      budget_->spend(1, tensor);
      if (lo >= hi) continue;
      while (k < iv_.size() && at + (iv_[k].stop - iv_[k].start) <= lo) {
        at += iv_[k].stop - iv_[k].start;
        ++k;
      }
      int64_t pos = at;
      for (size_t j = k; j < iv_.size() && pos < hi; ++j) {
        const int64_t len = iv_[j].stop - iv_[j].start;
        budget_->spend(1, tensor);
        const int64_t a = std::max(lo, pos), b = std::min(hi, pos + len);
        if (a < b) {
          const int64_t ga = iv_[j].start + (a - pos), gb = iv_[j].start + (b - pos);
          if (!next_.empty() && next_.back().stop == ga) {
            next_.back().stop = gb;
          } else {
            next_.push_back({ga, gb, 0});
          }
        }
        pos += len;
      }
    }
    iv_.swap(next_);
  }

  Budget* budget_;
  std::vector<Interval> iv_, next_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
};

// Per tensor dim, the intervals every position of a mesh holds.
struct MeshIntervals {
  std::vector<std::vector<std::vector<Interval>>> of;  // [position][dim]
  std::vector<int64_t> fragments;                      // per position: product of run counts
};

MeshIntervals mesh_intervals(const ShardedInput& in, const View& v, const int64_t* shape,
                             int64_t ndim, int64_t tensor, Budget* budget) {
  const auto ops = resolve_ops(in, v, ndim, tensor, budget);
  MeshIntervals out;
  out.of.resize(v.size);
  out.fragments.assign(v.size, 0);
  std::vector<int64_t> coords(v.mesh_ndim);
  DimCutter cutter(budget);
  int64_t all = 0;
  for (int64_t pos = 0; pos < v.size; ++pos) {
    for (int64_t m = v.mesh_ndim - 1, i = pos; m >= 0; --m) {
      coords[m] = i % in.mesh_shape[v.mesh_begin + m];
      i /= in.mesh_shape[v.mesh_begin + m];
    }
    budget->spend(1 + ndim + v.mesh_ndim, tensor);
    out.of[pos].resize(ndim);
    int64_t frags = 1;
    for (int64_t d = 0; d < ndim; ++d) {
      cutter.cut(shape[d], ops[d], coords, tensor, &out.of[pos][d]);
      budget->spend(static_cast<int64_t>(out.of[pos][d].size()), tensor);
      frags *= static_cast<int64_t>(out.of[pos][d].size());  // 0 stays 0; bounded below
      NEREUS_CHECK(frags <= kMaxPieces,
                   "tensor #" << tensor << ": a rank holds more than " << kMaxPieces << " boxes");
    }
    out.fragments[pos] = frags;
    all += frags;
    NEREUS_CHECK(all <= kMaxPieces,
                 "tensor #" << tensor << ": the ranks hold more than " << kMaxPieces << " boxes");
  }
  return out;
}

// Steps through the cartesian product of index ranges [lo[d], hi[d]), last dim fastest.
// With no dims there is exactly one (empty) combination.
bool next_combination(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                      std::vector<int64_t>* at) {
  for (int64_t d = static_cast<int64_t>(at->size()) - 1; d >= 0; --d) {
    if (++(*at)[d] < hi[d]) return true;
    (*at)[d] = lo[d];
  }
  return false;
}

// The cuts of one (shape, source sharding, destination sharding), in planning order.
struct Geometry {
  int64_t ndim = 0;
  // Source boxes: the product of each dim's distinct source runs (pairwise disjoint,
  // ascending), numbered row-major. Box b's holders, ascending by rank, are
  // [holder_offset[b], holder_offset[b + 1]): mesh position, and per dim the local
  // origin of the box's run.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs;
  std::vector<int64_t> holder_offset, holder_rank, holder_pos, holder_origin;
  // Cuts: destination rank and mesh position, source box, elements, and 2 * ndim
  // values each of the global box and the destination-local box.
  std::vector<int64_t> cut_rank, cut_pos, cut_box, cut_numel, cut_global, cut_dst_local;
  std::vector<int64_t> cut_run_start;  // ndim each: where the source box starts, per dim
};

Geometry build_geometry(const ShardedInput& in, const View& src, const View& dst,
                        const int64_t* shape, int64_t ndim, int64_t tensor, Budget* budget) {
  Geometry g;
  g.ndim = ndim;
  const MeshIntervals held = mesh_intervals(in, src, shape, ndim, tensor, budget);
  g.runs.resize(ndim);
  for (int64_t pos = 0; pos < src.size; ++pos) {
    if (held.fragments[pos] == 0) continue;
    for (int64_t d = 0; d < ndim; ++d)
      for (const Interval& x : held.of[pos][d]) g.runs[d].push_back({x.start, x.stop});
  }
  int64_t num_boxes = 1;
  std::vector<int64_t> stride(ndim, 1);
  for (int64_t d = ndim - 1; d >= 0; --d) {
    auto& r = g.runs[d];
    std::sort(r.begin(), r.end());
    r.erase(std::unique(r.begin(), r.end()), r.end());
    // Ranks with different coordinates hold disjoint runs, replicas identical ones.
    for (size_t i = 1; i < r.size(); ++i)
      NEREUS_CHECK(r[i - 1].second <= r[i].first,
                   "tensor #" << tensor << ": source runs overlap without being equal");
    stride[d] = num_boxes;
    num_boxes = mul(num_boxes, static_cast<int64_t>(r.size()), "the number of source boxes");
    NEREUS_CHECK(num_boxes <= kMaxPieces,
                 "tensor #" << tensor << ": more than " << kMaxPieces << " source boxes");
  }
  bool any_holder = false;
  for (int64_t pos = 0; pos < src.size && !any_holder; ++pos) any_holder = held.fragments[pos] > 0;
  if (!any_holder) num_boxes = 0;

  // Holders, ascending by rank within every box.
  std::vector<int64_t> by_rank(src.size);
  for (int64_t i = 0; i < src.size; ++i) by_rank[i] = i;
  std::sort(by_rank.begin(), by_rank.end(), [&](int64_t a, int64_t b) {
    return in.ranks[src.rank_begin + a] < in.ranks[src.rank_begin + b];
  });
  auto run_index = [&](int64_t d, const Interval& x) {
    const auto& r = g.runs[d];
    return static_cast<int64_t>(
        std::lower_bound(r.begin(), r.end(), std::make_pair(x.start, x.stop)) - r.begin());
  };
  std::vector<int64_t> lo(ndim, 0), hi(ndim), at(ndim);
  auto for_each_fragment = [&](int64_t pos, auto&& fn) {
    if (held.fragments[pos] == 0) return;
    const auto& iv = held.of[pos];
    for (int64_t d = 0; d < ndim; ++d) hi[d] = static_cast<int64_t>(iv[d].size());
    std::fill(at.begin(), at.end(), 0);
    do {
      int64_t box = 0;
      for (int64_t d = 0; d < ndim; ++d) box += run_index(d, iv[d][at[d]]) * stride[d];
      fn(box);
    } while (next_combination(lo, hi, &at));
  };
  g.holder_offset.assign(num_boxes + 1, 0);
  for (int64_t pos : by_rank)
    for_each_fragment(pos, [&](int64_t box) { ++g.holder_offset[box + 1]; });
  for (int64_t b = 0; b < num_boxes; ++b) g.holder_offset[b + 1] += g.holder_offset[b];
  const int64_t num_holders = g.holder_offset[num_boxes];
  g.holder_rank.resize(num_holders);
  g.holder_pos.resize(num_holders);
  g.holder_origin.resize(num_holders * ndim);
  std::vector<int64_t> fill(g.holder_offset.begin(), g.holder_offset.end() - 1);
  for (int64_t pos : by_rank) {
    for_each_fragment(pos, [&](int64_t box) {
      const int64_t h = fill[box]++;
      g.holder_rank[h] = in.ranks[src.rank_begin + pos];
      g.holder_pos[h] = pos;
      for (int64_t d = 0; d < ndim; ++d)
        g.holder_origin[h * ndim + d] = held.of[pos][d][at[d]].origin;
    });
  }

  // Cuts: destination ranks ascending, their fragments row-major, source boxes row-major.
  const MeshIntervals want = mesh_intervals(in, dst, shape, ndim, tensor, budget);
  std::vector<int64_t> dst_order(dst.size);
  for (int64_t i = 0; i < dst.size; ++i) dst_order[i] = i;
  std::sort(dst_order.begin(), dst_order.end(), [&](int64_t a, int64_t b) {
    return in.ranks[dst.rank_begin + a] < in.ranks[dst.rank_begin + b];
  });
  std::vector<int64_t> frag_at(ndim), frag_hi(ndim), frag_lo(ndim, 0), box_lo(ndim), box_hi(ndim),
      box_at(ndim);
  for (int64_t pos : dst_order) {
    if (want.fragments[pos] == 0 || num_boxes == 0) continue;
    const auto& iv = want.of[pos];
    for (int64_t d = 0; d < ndim; ++d) frag_hi[d] = static_cast<int64_t>(iv[d].size());
    std::fill(frag_at.begin(), frag_at.end(), 0);
    do {
      // The source runs each dim of this fragment overlaps: a contiguous index range.
      bool empty = false;
      for (int64_t d = 0; d < ndim && !empty; ++d) {
        const Interval& f = iv[d][frag_at[d]];
        const auto& r = g.runs[d];
        box_lo[d] = std::partition_point(r.begin(), r.end(),
                                         [&](const auto& x) { return x.second <= f.start; }) -
                    r.begin();
        box_hi[d] = std::partition_point(r.begin(), r.end(),
                                         [&](const auto& x) { return x.first < f.stop; }) -
                    r.begin();
        empty = box_lo[d] >= box_hi[d];
      }
      if (empty) continue;
      box_at = box_lo;
      do {
        budget->spend(1, tensor);
        int64_t box = 0;
        for (int64_t d = 0; d < ndim; ++d) box += box_at[d] * stride[d];
        if (g.holder_offset[box + 1] == g.holder_offset[box]) continue;
        int64_t numel = 1;
        g.cut_rank.push_back(in.ranks[dst.rank_begin + pos]);
        g.cut_pos.push_back(pos);
        g.cut_box.push_back(box);
        for (int64_t d = 0; d < ndim; ++d) {
          const Interval& f = iv[d][frag_at[d]];
          const auto& run = g.runs[d][box_at[d]];
          const int64_t a = std::max(f.start, run.first), b = std::min(f.stop, run.second);
          numel = mul(numel, b - a, "the elements of a box");
          g.cut_global.push_back(a);
          g.cut_global.push_back(b);
          g.cut_dst_local.push_back(a - f.start + f.origin);
          g.cut_dst_local.push_back(b - f.start + f.origin);
          g.cut_run_start.push_back(run.first);
        }
        g.cut_numel.push_back(numel);
      } while (next_combination(box_lo, box_hi, &box_at));
    } while (next_combination(frag_lo, frag_hi, &frag_at));
  }
  return g;
}

// Which (holder, receiver) pairs already carry a message; dense for small rank sets.
class PairSet {
 public:
  explicit PairSet(int64_t n) : n_(n) {
    if (n <= kDenseRanks) bits_.assign(static_cast<size_t>((n * n + 63) / 64), 0);
  }
  bool has(int64_t a, int64_t b) const {
    if (bits_.empty()) return set_.count(key(a, b)) != 0;
    const int64_t i = a * n_ + b;
    return (bits_[i >> 6] >> (i & 63)) & 1;
  }
  void insert(int64_t a, int64_t b) {
    if (bits_.empty()) {
      set_.insert(key(a, b));
      return;
    }
    const int64_t i = a * n_ + b;
    bits_[i >> 6] |= uint64_t{1} << (i & 63);
  }

 private:
  static constexpr int64_t kDenseRanks = 8192;  // 8 MiB of bits
  static uint64_t key(int64_t a, int64_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b);
  }
  int64_t n_;
  std::vector<uint64_t> bits_;
  std::unordered_set<uint64_t> set_;
};

}  // namespace

ShardedResult plan(const ShardedInput& in) {
  const std::vector<View> views = check_input(in);
  const int64_t n = static_cast<int64_t>(in.tensor_ndim.size());

  // Dense ids of every rank named anywhere, for the send loads and message pairs.
  std::vector<int64_t> all_ranks(in.ranks);
  std::sort(all_ranks.begin(), all_ranks.end());
  all_ranks.erase(std::unique(all_ranks.begin(), all_ranks.end()), all_ranks.end());
  std::vector<int64_t> dense(in.ranks.size());
  for (size_t i = 0; i < in.ranks.size(); ++i)
    dense[i] =
        std::lower_bound(all_ranks.begin(), all_ranks.end(), in.ranks[i]) - all_ranks.begin();
  std::vector<int64_t> load(all_ranks.size(), 0);
  PairSet pairs(static_cast<int64_t>(all_ranks.size()));

  std::map<std::vector<int64_t>, size_t> index;  // (src, dst, shape...) -> geometry
  std::vector<Geometry> geometries;
  Budget budget;
  ShardedResult R;
  R.box_offset.push_back(0);
  int64_t shape_at = 0;
  std::vector<int64_t> key;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t ndim = in.tensor_ndim[t];
    const int64_t* shape = in.tensor_shape.data() + shape_at;
    shape_at += ndim;
    const int64_t esize = in.tensor_elem_size[t];
    int64_t tensor_bytes = esize;
    for (int64_t d = 0; d < ndim; ++d) {
      NEREUS_CHECK(!__builtin_mul_overflow(tensor_bytes, shape[d], &tensor_bytes),
                   "tensor #" << t << ": its bytes exceed 2^63 - 1");
    }
    const View& src = views[in.tensor_src[t]];
    const View& dst = views[in.tensor_dst[t]];
    key.assign({in.tensor_src[t], in.tensor_dst[t]});
    key.insert(key.end(), shape, shape + ndim);
    auto [it, fresh] = index.emplace(key, geometries.size());
    if (fresh) geometries.push_back(build_geometry(in, src, dst, shape, ndim, t, &budget));
    const Geometry& g = geometries[it->second];

    const int64_t num_cuts = static_cast<int64_t>(g.cut_rank.size());
    for (int64_t c = 0; c < num_cuts; ++c) {
      const int64_t nbytes = g.cut_numel[c] * esize;  // at most the tensor's bytes
      if (nbytes == 0) continue;
      const int64_t r = g.cut_rank[c];
      const int64_t h0 = g.holder_offset[g.cut_box[c]], h1 = g.holder_offset[g.cut_box[c] + 1];
      const auto first = g.holder_rank.begin();
      const int64_t found = std::lower_bound(first + h0, first + h1, r) - first;
      const bool local = found < h1 && g.holder_rank[found] == r;
      int64_t h = found;
      if (!local) {
        // The receiver's node first, then the least loaded holder, then one already
        // sending to the receiver (one message less), then the lowest rank.
        const int64_t here = in.nodes[dst.rank_begin + g.cut_pos[c]];
        const int64_t rd = dense[dst.rank_begin + g.cut_pos[c]];
        budget.scan(h1 - h0, t);
        h = -1;
        bool best_far = false, best_new = false;
        int64_t best_load = 0;
        for (int64_t i = h0; i < h1; ++i) {
          const int64_t at = src.rank_begin + g.holder_pos[i];
          const bool far = in.nodes[at] != here;
          const int64_t l = load[dense[at]];
          const bool is_new = !pairs.has(dense[at], rd);
          if (h < 0 || std::tie(far, l, is_new) < std::tie(best_far, best_load, best_new)) {
            h = i;
            best_far = far;
            best_load = l;
            best_new = is_new;
          }
        }
        const int64_t hd = dense[src.rank_begin + g.holder_pos[h]];
        load[hd] = add(load[hd], nbytes, "a rank's bytes to send");
        pairs.insert(hd, rd);
        R.lower_bound_bytes = add(R.lower_bound_bytes, nbytes, "the bytes to send");
        R.remote_bytes = R.lower_bound_bytes;
        ++R.num_remote;
      } else {
        R.local_bytes = add(R.local_bytes, nbytes, "the bytes to copy locally");
      }
      NEREUS_CHECK(static_cast<int64_t>(R.tensor.size()) < kMaxPieces,
                   "tensor #" << t << ": the plan would hold more than " << kMaxPieces
                              << " pieces; plan fewer tensors at a time");
      NEREUS_CHECK(R.box_offset.back() + 2 * ndim <= kMaxBoxValues,
                   "tensor #" << t << ": the plan's boxes would hold more than " << kMaxBoxValues
                              << " values; plan fewer tensors at a time");
      R.tensor.push_back(t);
      R.src.push_back(g.holder_rank[h]);
      R.dst.push_back(r);
      R.nbytes.push_back(nbytes);
      R.remote.push_back(local ? 0 : 1);
      int64_t cut_length = local ? 0 : 1;
      const int64_t* box = g.cut_global.data() + c * 2 * ndim;
      const int64_t* dloc = g.cut_dst_local.data() + c * 2 * ndim;
      const int64_t* run_start = g.cut_run_start.data() + c * ndim;
      const int64_t* origin = g.holder_origin.data() + h * ndim;
      for (int64_t d = 0; d < ndim; ++d) {
        const int64_t a = box[2 * d], b = box[2 * d + 1];
        if (cut_length == 1 && b - a > 1) cut_length = b - a;
        R.box.push_back(a);
        R.box.push_back(b);
        R.src_local.push_back(a - run_start[d] + origin[d]);
        R.src_local.push_back(b - run_start[d] + origin[d]);
        R.dst_local.push_back(dloc[2 * d]);
        R.dst_local.push_back(dloc[2 * d + 1]);
      }
      R.cut_length.push_back(cut_length);
      R.box_offset.push_back(R.box_offset.back() + 2 * ndim);
    }
  }
  return R;
}

}  // namespace nereus::sharded
