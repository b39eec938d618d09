// Shard-remap planner: which bytes of which tensor move from which source rank
// to which destination rank when sharded state changes layout.
//
// Ranks are named by their position in their layout (dp-major, then pp, then tp).
// Every tensor is cut only along one dim (its split dim; replicated tensors are a
// one-element axis whose unit is the whole tensor), so every piece is an
// interval [start, stop) of that axis times `unit_bytes`.
//
// The planner never looks at rank pairs. Every dp replica of a (pp, tp)
// coordinate holds identical boxes, so intersections are computed once per
// destination shard class (p, t) into "blocks": the items a destination needs
// that one holder group (the source ranks holding the same bytes) can give.
// Destination ranks then take whole blocks locally or from one holder per
// block part, chosen to balance bytes sent per source and to stay on-node.
#pragma once

#include <cstdint>
#include <vector>

namespace nereus::remap {

// dp x tp x pp over positions 0..dp*tp*pp-1 with a node id per position.
struct Grid {
  int64_t dp = 1, tp = 1, pp = 1;
  std::vector<int32_t> node;  // node id per position
  int64_t size() const { return dp * tp * pp; }
};

// One tensor as the planner sees it.
struct TensorInfo {
  int64_t length;      // split-dim length (1 for replicated tensors)
  int64_t unit_bytes;  // bytes per unit of the split axis
  bool split;          // cut over tp (torch.chunk semantics)
  int32_t src_stage;   // pipeline stage in the source layout, -1 = every stage
  int32_t dst_stage;   // pipeline stage in the destination layout, -1 = every stage
};

struct PlanInput {
  Grid src, dst;
  std::vector<int64_t> dst_in_src;  // per destination position: its source position or -1
  std::vector<TensorInfo> tensors;
};

// The compact plan. Items are (tensor, start, stop) intervals, grouped into
// blocks (contiguous item ranges). An assignment sends items [begin, end) of a
// block from one source to one destination. Everything a destination already
// holds is a local block.
struct PlanResult {
  // items
  std::vector<int32_t> item_tensor;
  std::vector<int64_t> item_start, item_stop, item_bytes;
  // blocks: item range [block_offset[b], block_offset[b + 1])
  std::vector<int64_t> block_offset;
  // assignments, sorted by (dst, src, begin)
  std::vector<int64_t> asg_dst, asg_src, asg_begin, asg_end, asg_bytes;
  // assignment indices sorted by (src, dst, begin)
  std::vector<int64_t> send_order;
  // local blocks, sorted by dst position
  std::vector<int64_t> local_dst, local_block;
  // per-rank totals
  std::vector<int64_t> send_bytes;   // per source position
  std::vector<int64_t> recv_bytes;   // per destination position
  std::vector<int64_t> local_bytes;  // per destination position
  // stats
  int64_t total_bytes = 0, lower_bound_bytes = 0, local_total = 0;
  int64_t max_send_bytes = 0, max_recv_bytes = 0, cross_node_bytes = 0;
  int64_t num_messages = 0;
  // a destination item no source holds: its tensor, else -1
  int32_t uncovered_tensor = -1;
};

// Plans the remap. Deterministic: the same input always gives the same plan.
// Throws CallerError on malformed input (sizes that disagree).
PlanResult plan(const PlanInput& in);

}  // namespace nereus::remap
