// Shard-remap planner (see planner.h for the model).
#include "remap/planner.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <utility>

#include "common.h"

namespace nereus::remap {
namespace {

// torch.chunk: chunk = ceil(n / parts); trailing chunks may be short or empty.
void chunk_range(int64_t n, int64_t parts, int64_t index, int64_t* start, int64_t* stop) {
  const int64_t size = n > 0 ? (n + parts - 1) / parts : 0;
  *start = std::min(index * size, n);
  *stop = std::min(*start + size, n);
}

// What one more message costs, in bytes of transfer time (a few microseconds of
// latency at tens of GB/s): a holder already sending to a receiver may carry
// this much more load than the balance rule allows, to save a message.
constexpr int64_t kMessageCostBytes = 64 << 10;

struct Block {
  int64_t group;  // holder-group key
  int64_t begin, end;
  int64_t bytes;
};

// A needer's share of one block, to be sent by one holder.
struct Part {
  int64_t bytes, dst, index, block, begin, end;
  bool near;  // some holder is on the receiver's node
};

// Holder groups are keyed by (stage, tp coordinate) of the source layout, -1
// meaning "every"; the key is canonical (-1 whenever the degree is 1), so two
// keys never name the same set of ranks.
class GroupKeys {
 public:
  explicit GroupKeys(const Grid& src) : src_(src) {}
  int64_t count() const { return (src_.pp + 1) * (src_.tp + 1); }
  int64_t key(int64_t gp, int64_t gt) const { return (gp + 1) * (src_.tp + 1) + (gt + 1); }
  int64_t stage(int64_t key) const { return key / (src_.tp + 1) - 1; }
  int64_t coord(int64_t key) const { return key % (src_.tp + 1) - 1; }
  bool holds(int64_t key, int64_t src_pos) const {
    const int64_t gp = stage(key), gt = coord(key);
    return (gp < 0 || gp == (src_pos / src_.tp) % src_.pp) && (gt < 0 || gt == src_pos % src_.tp);
  }
  std::vector<int64_t> holders(int64_t key) const {
    const int64_t gp = stage(key), gt = coord(key);
    std::vector<int64_t> out;
    for (int64_t d = 0; d < src_.dp; ++d)
      for (int64_t p = gp < 0 ? 0 : gp; p < (gp < 0 ? src_.pp : gp + 1); ++p)
        for (int64_t t = gt < 0 ? 0 : gt; t < (gt < 0 ? src_.tp : gt + 1); ++t)
          out.push_back((d * src_.pp + p) * src_.tp + t);
    return out;
  }

 private:
  const Grid& src_;
};

void check_input(const PlanInput& in) {
  for (const Grid* g : {&in.src, &in.dst}) {
    NEREUS_CHECK(g->dp >= 1 && g->tp >= 1 && g->pp >= 1, "degrees must be >= 1");
    NEREUS_CHECK(static_cast<int64_t>(g->node.size()) == g->size(), "one node id per rank");
  }
  NEREUS_CHECK(static_cast<int64_t>(in.dst_in_src.size()) == in.dst.size(),
               "dst_in_src needs one entry per destination rank");
  for (int64_t q : in.dst_in_src) NEREUS_CHECK(q >= -1 && q < in.src.size(), "bad source position");
  for (const TensorInfo& t : in.tensors) {
    NEREUS_CHECK(t.length >= 0 && t.unit_bytes >= 0, "negative tensor size");
    NEREUS_CHECK(t.src_stage >= -1 && t.src_stage < in.src.pp, "source stage out of range");
    NEREUS_CHECK(t.dst_stage >= -1 && t.dst_stage < in.dst.pp, "destination stage out of range");
  }
}

}  // namespace

PlanResult plan(const PlanInput& in) {
  check_input(in);
  const Grid& S = in.src;
  const Grid& D = in.dst;
  const GroupKeys keys(S);
  PlanResult R;

  // 1. Blocks per destination shard class (p, t): the items every dp replica of
  // that class needs, grouped by the source ranks that hold them.
  const int64_t num_classes = D.pp * D.tp;
  std::vector<std::vector<int64_t>> class_blocks(num_classes);
  std::vector<Block> blocks;
  std::vector<std::vector<std::pair<int32_t, std::pair<int64_t, int64_t>>>> pending(keys.count());
  std::vector<int64_t> touched;
  for (int64_t c = 0; c < num_classes; ++c) {
    const int64_t p = c / D.tp, t = c % D.tp;
    touched.clear();
    for (size_t i = 0; i < in.tensors.size(); ++i) {
      const TensorInfo& ti = in.tensors[i];
      if (ti.dst_stage >= 0 && ti.dst_stage != p) continue;
      if (ti.unit_bytes == 0) continue;
      int64_t a = 0, b = ti.length;
      if (ti.split) chunk_range(ti.length, D.tp, t, &a, &b);
      if (a >= b) continue;
      const int64_t gp = (ti.src_stage < 0 || S.pp == 1) ? -1 : ti.src_stage;
      auto add = [&](int64_t gt, int64_t s0, int64_t s1) {
        auto& list = pending[keys.key(gp, gt)];
        if (list.empty()) touched.push_back(keys.key(gp, gt));
        list.push_back({static_cast<int32_t>(i), {s0, s1}});
      };
      if (!ti.split || S.tp == 1) {
        add(-1, a, b);
        continue;
      }
      const int64_t size = (ti.length + S.tp - 1) / S.tp;
      for (int64_t st = a / size; st <= (b - 1) / size; ++st)
        add(st, std::max(a, st * size), std::min(b, (st + 1) * size));
    }
    std::sort(touched.begin(), touched.end());
    for (int64_t key : touched) {
      Block blk{key, static_cast<int64_t>(R.item_tensor.size()), 0, 0};
      for (const auto& [tensor, range] : pending[key]) {
        const int64_t bytes = (range.second - range.first) * in.tensors[tensor].unit_bytes;
        R.item_tensor.push_back(tensor);
        R.item_start.push_back(range.first);
        R.item_stop.push_back(range.second);
        R.item_bytes.push_back(bytes);
        blk.bytes += bytes;
      }
      blk.end = static_cast<int64_t>(R.item_tensor.size());
      pending[key].clear();
      class_blocks[c].push_back(static_cast<int64_t>(blocks.size()));
      blocks.push_back(blk);
    }
  }
  R.block_offset.reserve(blocks.size() + 1);
  for (const Block& b : blocks) R.block_offset.push_back(b.begin);
  R.block_offset.push_back(static_cast<int64_t>(R.item_tensor.size()));
  std::vector<int64_t> prefix(R.item_bytes.size() + 1, 0);
  std::partial_sum(R.item_bytes.begin(), R.item_bytes.end(), prefix.begin() + 1);

  // 2. Each destination rank takes its class's blocks: locally when it is in
  // the block's holder group, otherwise it becomes a needer of that group.
  const int64_t num_dst = D.size(), num_src = S.size();
  R.recv_bytes.assign(num_dst, 0);
  R.local_bytes.assign(num_dst, 0);
  R.send_bytes.assign(num_src, 0);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> needers(keys.count());
  for (int64_t r = 0; r < num_dst; ++r) {
    const int64_t q = in.dst_in_src[r];
    for (int64_t b : class_blocks[r % num_classes]) {
      R.lower_bound_bytes += blocks[b].bytes;
      if (q >= 0 && keys.holds(blocks[b].group, q)) {
        R.local_dst.push_back(r);
        R.local_block.push_back(b);
        R.local_bytes[r] += blocks[b].bytes;
      } else {
        needers[blocks[b].group].push_back({r, b});
      }
    }
  }
  for (int64_t r = 0; r < num_dst; ++r) R.local_total += R.local_bytes[r];
  R.lower_bound_bytes -= R.local_total;

  // 3. Groups in a fixed order so that the balancing below is reproducible:
  // smallest holder sets first (they have the fewest choices; the big replicated
  // groups then can reuse the pairs already chosen), ties by holder list.
  std::vector<std::pair<std::vector<int64_t>, int64_t>> groups;
  for (int64_t key = 0; key < keys.count(); ++key)
    if (!needers[key].empty()) groups.push_back({keys.holders(key), key});
  std::sort(groups.begin(), groups.end(), [](const auto& x, const auto& y) {
    if (x.first.size() != y.first.size()) return x.first.size() < y.first.size();
    return x < y;
  });

  // 4. Assign each needer's block to holders. With fewer needers than holders a
  // block is cut into k = holders / needers parts of about equal bytes so that
  // the holders share the work. Parts (those whose receiver has a holder on its
  // node first, then largest first) go to the holder with the lowest load, unless
  // a holder that already sends to the receiver (saves a message), or else one on
  // the receiver's node (saves cross-node bytes), can take the part within the
  // cap: the larger of the group's highest load, the lowest load plus the part,
  // and the holders' mean load once the group is placed (a holder already sending
  // may exceed the cap by kMessageCostBytes). So, as in list scheduling, the
  // group's highest load ends at most at max(the highest load before the group,
  // the mean + the largest part) + kMessageCostBytes.
  std::vector<int64_t>& load = R.send_bytes;
  std::vector<std::vector<int64_t>> peers(num_dst);  // sources chosen per receiver
  std::vector<Part> parts;
  for (const auto& [holders, key] : groups) {
    const auto& need = needers[key];
    const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(holders.size() / need.size()));
    parts.clear();
    for (const auto& [r, b] : need) {
      const Block& blk = blocks[b];
      const int64_t kr = std::min<int64_t>(k, blk.end - blk.begin);
      int64_t begin = blk.begin;
      for (int64_t j = 0; j < kr; ++j) {
        int64_t end = blk.end;
        if (j + 1 < kr) {
          // first item boundary i with (prefix[i] - base) * kr >= bytes * (j + 1)
          const int64_t want = prefix[blk.begin] + (blk.bytes * (j + 1) + kr - 1) / kr;
          end = std::lower_bound(prefix.begin() + blk.begin, prefix.begin() + blk.end + 1, want) -
                prefix.begin();
        }
        if (end > begin) parts.push_back({prefix[end] - prefix[begin], r, j, b, begin, end, false});
        begin = end;
      }
    }
    using Entry = std::pair<int64_t, int64_t>;  // (load, source position)
    std::set<Entry> all;
    std::map<int32_t, std::set<Entry>> by_node;
    for (int64_t s : holders) {
      all.insert({load[s], s});
      by_node[S.node[s]].insert({load[s], s});
    }
    int64_t mean = 0;  // the group's holders' mean load once every part is placed
    for (int64_t s : holders) mean += load[s];
    for (Part& part : parts) {
      part.near = by_node.count(D.node[part.dst]) > 0;
      mean += part.bytes;
    }
    const int64_t h = static_cast<int64_t>(holders.size());
    mean = (mean + h - 1) / h;
    // Parts with an on-node holder first, so that receivers elsewhere do not take
    // those holders' capacity; then largest first.
    std::sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) {
      if (x.near != y.near) return x.near;
      if (x.bytes != y.bytes) return x.bytes > y.bytes;
      if (x.dst != y.dst) return x.dst < y.dst;
      return x.index < y.index;
    });
    for (const Part& part : parts) {
      const int32_t node = D.node[part.dst];
      Entry best = *all.begin();
      const int64_t cap = std::max({all.rbegin()->first, best.first + part.bytes, mean});
      bool found = false;
      Entry pick{0, 0};
      for (int64_t q : peers[part.dst]) {
        const Entry cand{load[q], q};
        const bool fits = cand.first + part.bytes <= cap + kMessageCostBytes;
        if (keys.holds(key, q) && fits && (!found || cand < pick)) {
          pick = cand;
          found = true;
        }
      }
      auto same = by_node.find(node);
      if (!found && same != by_node.end()) {
        const Entry cand = *same->second.begin();
        if (cand.first + part.bytes <= cap) {
          pick = cand;
          found = true;
        }
      }
      if (found) best = pick;
      const int64_t s = best.second;
      all.erase(best);
      auto& own = by_node[S.node[s]];
      own.erase(best);
      load[s] += part.bytes;
      if (std::find(peers[part.dst].begin(), peers[part.dst].end(), s) == peers[part.dst].end())
        peers[part.dst].push_back(s);
      all.insert({load[s], s});
      own.insert({load[s], s});
      R.asg_dst.push_back(part.dst);
      R.asg_src.push_back(s);
      R.asg_begin.push_back(part.begin);
      R.asg_end.push_back(part.end);
      R.asg_bytes.push_back(part.bytes);
    }
  }

  // 5. Sort assignments per (dst, src) pair, index them per (src, dst), and
  // derive the stats.
  const size_t num_asg = R.asg_dst.size();
  std::vector<int64_t> order(num_asg);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return std::tie(R.asg_dst[x], R.asg_src[x], R.asg_begin[x]) <
           std::tie(R.asg_dst[y], R.asg_src[y], R.asg_begin[y]);
  });
  auto permute = [&](std::vector<int64_t>& v) {
    std::vector<int64_t> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = v[order[i]];
    v.swap(out);
  };
  permute(R.asg_dst);
  permute(R.asg_src);
  permute(R.asg_begin);
  permute(R.asg_end);
  permute(R.asg_bytes);
  R.send_order.resize(num_asg);
  std::iota(R.send_order.begin(), R.send_order.end(), 0);
  std::sort(R.send_order.begin(), R.send_order.end(), [&](int64_t x, int64_t y) {
    return std::tie(R.asg_src[x], R.asg_dst[x], R.asg_begin[x]) <
           std::tie(R.asg_src[y], R.asg_dst[y], R.asg_begin[y]);
  });
  for (size_t i = 0; i < num_asg; ++i) {
    const int64_t dst = R.asg_dst[i], src = R.asg_src[i], bytes = R.asg_bytes[i];
    R.total_bytes += bytes;
    R.recv_bytes[dst] += bytes;
    if (S.node[src] != D.node[dst]) R.cross_node_bytes += bytes;
    if (i == 0 || R.asg_dst[i - 1] != dst || R.asg_src[i - 1] != src) ++R.num_messages;
  }
  for (int64_t v : R.send_bytes) R.max_send_bytes = std::max(R.max_send_bytes, v);
  for (int64_t v : R.recv_bytes) R.max_recv_bytes = std::max(R.max_recv_bytes, v);
  return R;
}

}  // namespace nereus::remap
