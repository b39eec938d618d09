// Sharded planner: which box of which tensor moves from which rank to which when
// tensors laid out over N-D meshes (Shard / Replicate / StridedShard per mesh dim,
// torch.chunk semantics, DTensor's shard_order) change layout.
//
// Every destination fragment (a box a rank holds) is cut by the distinct source
// boxes it overlaps; a cut the receiver already holds is a local copy, every other
// cut is fetched once from one holder, chosen in this order: a holder on the
// receiver's node, the holder with the fewest bytes to send so far, one already
// sending to the receiver, the lowest rank. Pieces come out per tensor, per
// destination rank (ascending), per destination fragment, per source box
// (lexicographic); the loads carry over from tensor to tensor. The bytes sent
// equal the lower bound: the bytes of destination shards their rank lacks.
//
// Geometry (the cuts and their holders) is computed once per distinct
// (shape, source sharding, destination sharding), so the layers of a model share it.
#pragma once

#include <cstdint>
#include <vector>

namespace nereus::sharded {

// What one mesh dim does to a tensor.
enum Kind : int64_t { kReplicate = 0, kShard = 1, kStridedShard = 2 };

// The planner's input: flat arrays, every count checked by plan().
struct ShardedInput {
  // Per tensor: number of dims, element size in bytes, and the index of its source
  // and destination sharding; tensor_shape holds every tensor's sizes back to back.
  std::vector<int64_t> tensor_ndim, tensor_elem_size, tensor_src, tensor_dst;
  std::vector<int64_t> tensor_shape;
  // Per sharding: number of mesh dims. Per mesh dim (back to back over the
  // shardings): its size, placement kind, tensor dim and split factor (the last two
  // read only where the kind uses them). Per mesh entry (prod(mesh sizes) per
  // sharding, row-major): global rank and node id.
  std::vector<int64_t> mesh_ndim;
  std::vector<int64_t> mesh_shape, kind, dim, split_factor;
  std::vector<int64_t> ranks, nodes;
  // shard_order: sharding s's entries are order[order_offset[s], order_offset[s + 1]),
  // a sequence of groups (tensor dim, count, count mesh dims); a later group for
  // the same tensor dim replaces an earlier one. A tensor dim with a group takes
  // exactly the group's mesh dims in the group's order; others take their mesh dims
  // left to right.
  std::vector<int64_t> order_offset, order;
};

// The pieces, in planning order. Piece i's boxes are (start, stop) pairs per tensor
// dim at [box_offset[i], box_offset[i + 1]) of box (global), src_local and
// dst_local (the same box in the source and destination local shards).
struct ShardedResult {
  std::vector<int64_t> tensor, src, dst, nbytes;
  std::vector<uint8_t> remote;  // 1: fetched from src, 0: copied on its own rank
  // Remote pieces only (0 for a local one): the length of the piece's first dim
  // longer than 1 (1 when there is none), the axis a reshard plan may cut it on.
  std::vector<int64_t> cut_length;
  std::vector<int64_t> box_offset;
  std::vector<int64_t> box, src_local, dst_local;
  int64_t lower_bound_bytes = 0, remote_bytes = 0, local_bytes = 0, num_remote = 0;
};

// The most pieces (and, separately, box entries) one plan may hold: a bound on the
// memory a malformed or hostile input can make the planner take.
constexpr int64_t kMaxPieces = int64_t{1} << 23;
constexpr int64_t kMaxBoxValues = int64_t{1} << 25;

// Plans the move. Deterministic. Throws CallerError on malformed input (sizes that
// disagree, negative or out-of-range values, repeated ranks, a placement on a dim
// the tensor lacks, byte counts past int64, more than kMaxPieces pieces); messages
// about one tensor start with "tensor #<index>:".
ShardedResult plan(const ShardedInput& in);

}  // namespace nereus::sharded
