// Shard-remap planner (see planner.h for the model).
#include "remap/planner.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>

#include "common.h"
#include "remap/chunk.h"

namespace nereus::remap {
namespace {

// What one more message costs, in bytes of transfer time (a few microseconds of
// latency at tens of GB/s): a holder already sending to a receiver may carry
// this much more than its share, to save a message.
constexpr int64_t kMessageCostBytes = 64 << 10;

// The smallest piece a cut inside a tensor leaves, and the smallest share a
// holder takes of a receiver's block (unless it ends the block). At 4x the cost
// of a message, a message or piece spends at most ~1/5 of its time on fixed
// costs (posting it, one more pack region), while a holder's send exceeds the
// balanced level by at most ~2 pieces: <= 2% once it sends >= 32 MiB (the
// 3,264 -> 3,265 rank case). Smaller would fragment messages for no gain.
constexpr int64_t kMinPieceBytes = 4 * kMessageCostBytes;  // 256 KiB

struct Block {
  int64_t group;  // holder-group key
  int64_t begin, end;
  int64_t bytes;
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
    int64_t size = 0;
    NEREUS_CHECK(!__builtin_mul_overflow(g->dp, g->tp, &size) &&
                     !__builtin_mul_overflow(size, g->pp, &size) && size <= (int64_t{1} << 31),
                 "dp x tp x pp must be at most 2^31 ranks");
    NEREUS_CHECK(static_cast<int64_t>(g->node.size()) == g->size(), "one node id per rank");
  }
  NEREUS_CHECK(static_cast<int64_t>(in.dst_in_src.size()) == in.dst.size(),
               "dst_in_src needs one entry per destination rank");
  for (int64_t q : in.dst_in_src) NEREUS_CHECK(q >= -1 && q < in.src.size(), "bad source position");
  // Every byte count the planner forms (an item, a block, a rank's or the plan's total)
  // is at most the bytes of all tensors times the destination ranks: that must fit int64.
  int64_t all_bytes = 0, all_ranks_bytes = 0;
  for (size_t i = 0; i < in.tensors.size(); ++i) {
    const TensorInfo& t = in.tensors[i];
    NEREUS_CHECK(t.length >= 0 && t.unit_bytes >= 0, "negative tensor size");
    int64_t bytes = 0;
    NEREUS_CHECK(!__builtin_mul_overflow(t.length, t.unit_bytes, &bytes) &&
                     !__builtin_add_overflow(all_bytes, bytes, &all_bytes),
                 "tensor " << i << " (" << t.length << " units of " << t.unit_bytes
                           << " bytes) brings the bytes of all tensors past 2^63 - 1");
    NEREUS_CHECK(t.src_stage >= -1 && t.src_stage < in.src.pp, "source stage out of range");
    NEREUS_CHECK(t.dst_stage >= -1 && t.dst_stage < in.dst.pp, "destination stage out of range");
  }
  NEREUS_CHECK(
      !__builtin_mul_overflow(all_bytes, std::max(in.src.size(), in.dst.size()), &all_ranks_bytes),
      "the tensors' " << all_bytes << " bytes times the ranks overflow int64");
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
      if (ti.split) std::tie(a, b) = chunk_range(ti.length, D.tp, t);
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

  // 4. Spread each group's needs over its holders. The water level L is the
  // lowest load at which the holders below it can take every needed byte;
  // holder h may take cap = L - load[h] (none when above L). Each receiver's
  // block is handed out front to back in pieces, each holder's cap used up in
  // turn (McNaughton's wrap-around rule), in three passes:
  //   a. holders already sending to the receiver (no new message) may take
  //      up to room = max(cap, the group's highest load before - load): all
  //      the rest if it fits within room + kMessageCostBytes, else up to room
  //      (so riding along never raises the group's highest load);
  //   b. per node, the receivers there from the holders there (fills caps in
  //      position order);
  //   c. the rest from any holder with cap left, in position order.
  // A share is at least kMinPieceBytes (unless it ends the block), ends at an
  // allowed cut (next_cut) and leaves no less than kMinPieceBytes of the block
  // behind, so a holder ends above max(L, its load before, in pass a the
  // highest load) by less than four pieces plus one unit of the cut axis.
  std::vector<int64_t>& load = R.send_bytes;
  std::vector<int64_t> cap(num_src, 0);
  std::vector<std::vector<int64_t>> peers(num_dst);  // sources chosen per receiver, sorted
  // The first allowed cut at or after byte offset o of the block [lo_item,
  // hi_item): an item boundary, or a unit boundary inside an item at least
  // kMinPieceBytes from both of its ends.
  auto next_cut = [&](int64_t o, int64_t lo_item, int64_t hi_item) {
    if (o >= prefix[hi_item]) return prefix[hi_item];
    const int64_t i = std::upper_bound(prefix.begin() + lo_item, prefix.begin() + hi_item + 1, o) -
                      prefix.begin() - 1;
    if (o == prefix[i]) return o;
    const int64_t unit = in.tensors[R.item_tensor[i]].unit_bytes;
    const int64_t within = std::max(o - prefix[i], kMinPieceBytes);
    const int64_t c = (within + unit - 1) / unit * unit;
    return c <= R.item_bytes[i] - kMinPieceBytes ? prefix[i] + c : prefix[i + 1];
  };
  // per needer of the group: its next byte to hand out and its block's end (prefix offsets)
  std::vector<int64_t> pos, stop;
  std::vector<int64_t> sorted_loads;
  for (const auto& [holders, key] : groups) {
    const auto& need = needers[key];
    const int64_t n = static_cast<int64_t>(need.size());
    pos.resize(n);
    stop.resize(n);
    int64_t want = 0;
    for (int64_t j = 0; j < n; ++j) {
      const Block& blk = blocks[need[j].second];
      pos[j] = prefix[blk.begin];
      stop[j] = prefix[blk.end];
      want += blk.bytes;
    }
    // water level: the least L with sum over holders of max(0, L - load) >= want
    sorted_loads.clear();
    for (int64_t s : holders) sorted_loads.push_back(load[s]);
    std::sort(sorted_loads.begin(), sorted_loads.end());
    int64_t level = 0, acc = 0;
    const int64_t h = static_cast<int64_t>(holders.size());
    for (int64_t k = 1; k <= h; ++k) {
      acc += sorted_loads[k - 1];
      level = (want + acc + k - 1) / k;
      if (k == h || level <= sorted_loads[k]) break;
    }
    for (int64_t s : holders) cap[s] = std::max<int64_t>(0, level - load[s]);
    const int64_t highest = sorted_loads.back();

    auto give = [&](int64_t j, int64_t s, int64_t upto) {
      const int64_t r = need[j].first;
      const int64_t from = pos[j], bytes = upto - from;
      const int64_t i0 = std::upper_bound(prefix.begin(), prefix.end(), from) - prefix.begin() - 1;
      const int64_t i1 = std::lower_bound(prefix.begin(), prefix.end(), upto) - prefix.begin();
      const int64_t u0 = in.tensors[R.item_tensor[i0]].unit_bytes;
      const int64_t u1 = in.tensors[R.item_tensor[i1 - 1]].unit_bytes;
      R.asg_dst.push_back(r);
      R.asg_src.push_back(s);
      R.asg_begin.push_back(i0);
      R.asg_end.push_back(i1);
      R.asg_lo.push_back(R.item_start[i0] + (from - prefix[i0]) / u0);
      R.asg_hi.push_back(R.item_start[i1 - 1] + (upto - prefix[i1 - 1]) / u1);
      R.asg_bytes.push_back(bytes);
      load[s] += bytes;
      cap[s] -= bytes;
      pos[j] = upto;
      auto& mine = peers[r];
      auto at = std::lower_bound(mine.begin(), mine.end(), s);
      if (at == mine.end() || *at != s) mine.insert(at, s);
    };
    // one share of receiver j's block for holder s: `room` bytes, at least a
    // piece, and all of the block when less than a piece would be left
    auto share = [&](int64_t j, int64_t s, int64_t room) {
      const Block& blk = blocks[need[j].second];
      const int64_t target = std::min(stop[j], pos[j] + std::max(room, kMinPieceBytes));
      int64_t upto = next_cut(target, blk.begin, blk.end);
      if (stop[j] - upto < kMinPieceBytes) upto = stop[j];
      give(j, s, upto);
    };
    // wrap-around: receivers js in order, from holders hs in order while they have cap
    auto fill = [&](const std::vector<int64_t>& js, const std::vector<int64_t>& hs) {
      size_t at = 0;
      for (int64_t j : js) {
        while (pos[j] < stop[j]) {
          while (at < hs.size() && cap[hs[at]] <= 0) ++at;
          if (at == hs.size()) return;
          share(j, hs[at], cap[hs[at]]);
        }
      }
    };

    // a. holders that already send to the receiver
    for (int64_t j = 0; j < n; ++j) {
      // give() never inserts here (s is already a peer), so the reference stays valid
      const std::vector<int64_t>& mine = peers[need[j].first];
      for (int64_t s : mine) {
        if (pos[j] == stop[j]) break;
        if (!keys.holds(key, s)) continue;
        const int64_t room = std::max(cap[s], highest - load[s]);
        if (stop[j] - pos[j] <= room + kMessageCostBytes) {
          give(j, s, stop[j]);
        } else if (room > 0) {
          share(j, s, room);
        }
      }
    }
    // b. per node: receivers from holders on their own node
    std::map<int32_t, std::pair<std::vector<int64_t>, std::vector<int64_t>>> nodes;
    for (int64_t s : holders) nodes[S.node[s]].second.push_back(s);
    for (int64_t j = 0; j < n; ++j) {
      auto it = nodes.find(D.node[need[j].first]);
      if (pos[j] < stop[j] && it != nodes.end()) it->second.first.push_back(j);
    }
    for (const auto& [node, members] : nodes) fill(members.first, members.second);
    // c. the rest from any holder with cap left; caps sum to >= want, and every
    // share uses up its holder's cap or ends its receiver's block, so this ends
    // with every byte handed out
    std::vector<int64_t> rest;
    for (int64_t j = 0; j < n; ++j)
      if (pos[j] < stop[j]) rest.push_back(j);
    fill(rest, holders);
    for (int64_t j = 0; j < n; ++j)
      NEREUS_CHECK(pos[j] == stop[j], "remap: a need was left unplaced");
  }

  // 5. Sort assignments per (dst, src) pair, index them per (src, dst), and
  // derive the stats.
  const size_t num_asg = R.asg_dst.size();
  std::vector<int64_t> order(num_asg);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return std::tie(R.asg_dst[x], R.asg_src[x], R.asg_begin[x], R.asg_lo[x]) <
           std::tie(R.asg_dst[y], R.asg_src[y], R.asg_begin[y], R.asg_lo[y]);
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
  permute(R.asg_lo);
  permute(R.asg_hi);
  permute(R.asg_bytes);
  R.send_order.resize(num_asg);
  std::iota(R.send_order.begin(), R.send_order.end(), 0);
  std::sort(R.send_order.begin(), R.send_order.end(), [&](int64_t x, int64_t y) {
    return std::tie(R.asg_src[x], R.asg_dst[x], R.asg_begin[x], R.asg_lo[x]) <
           std::tie(R.asg_src[y], R.asg_dst[y], R.asg_begin[y], R.asg_lo[y]);
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
