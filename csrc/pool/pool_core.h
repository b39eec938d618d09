// Decision logic of the communicator pool. No NCCL, no torch: the core decides
// how a communicator for an ordered rank tuple is obtained (reuse, split,
// shrink, grow or fresh init), the Python side carries the decision out and
// reports back the new handle and the seconds it took.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace nereus {

using RankKey = std::vector<int>;

// How the communicator for a request is obtained.
enum class PoolAction { kHit, kSplit, kShrink, kGrow, kInit };

// Name of an action ("hit", "split", "shrink", "grow", "init").
const char* pool_action_name(PoolAction action);

// What the caller must do to serve a request. parent/parent_handle are set for
// split, shrink and grow; handle for a hit. A handle of -1 means "this process
// is not a member of that communicator".
struct PoolDecision {
  PoolAction action = PoolAction::kInit;
  RankKey key;
  RankKey parent;
  int64_t parent_handle = -1;
  int64_t handle = -1;
};

// A communicator the caller must destroy (broken: abort rather than destroy,
// because a member died).
struct PoolDisposal {
  RankKey key;
  int64_t handle = -1;
  bool broken = false;
};

// Counters of a pool's life.
struct PoolCounters {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t splits = 0;
  int64_t shrinks = 0;
  int64_t grows = 0;
  int64_t inits = 0;
  int64_t evictions = 0;
  int64_t failures = 0;
  double create_seconds = 0.0;
};

// Bounded LRU cache of communicators keyed by ordered rank tuples.
//
// Every process of a job calls the same methods in the same order with the same
// arguments (like torch.distributed.new_group), so every process reaches the
// same decisions: ties are broken by key order, never by hash order.
class PoolCore {
 public:
  // capacity: most cached communicators (pinned ones may exceed it until released).
  PoolCore(int64_t capacity, bool can_split, bool can_shrink, bool can_grow);

  // Decide how to serve `ranks`. A hit pins the entry and is final; any other
  // decision reserves the key until commit() or abort().
  PoolDecision acquire(const RankKey& ranks);
  // Record the communicator created for a pending key (pinned once); returns
  // the communicators the caller must now destroy (evicted, or shrunk away).
  std::vector<PoolDisposal> commit(const RankKey& ranks, int64_t handle, double seconds);
  // Creation of a pending key failed: forget the reservation.
  void abort(const RankKey& ranks);
  // Drop one pin of a cached key; returns what eviction now frees.
  std::vector<PoolDisposal> release(const RankKey& ranks);
  // Mark ranks as lost; returns the cached keys that are now broken (in key order).
  std::vector<RankKey> mark_lost(const std::vector<int>& dead);
  // Forget every entry and every lost rank; returns the entries for destruction.
  std::vector<PoolDisposal> clear();

  PoolCounters counters() const { return counters_; }
  int64_t capacity() const { return capacity_; }
  int64_t size() const { return static_cast<int64_t>(entries_.size()); }
  // Cached keys, least recently used first.
  std::vector<RankKey> lru_order() const;
  int64_t pins(const RankKey& ranks) const;
  bool is_broken(const RankKey& ranks) const;
  std::vector<int> dead_ranks() const { return {dead_.begin(), dead_.end()}; }

 private:
  struct Entry {
    int64_t handle = -1;
    int64_t pins = 0;
    uint64_t last_used = 0;
    bool broken = false;
    bool pending = false;
  };

  void check_request(const RankKey& ranks) const;
  Entry& pending_entry(const RankKey& ranks);
  void unpin_parent(const RankKey& ranks);
  std::vector<PoolDisposal> evict_over_capacity();

  int64_t capacity_;
  bool can_split_;
  bool can_shrink_;
  bool can_grow_;
  uint64_t tick_ = 0;
  std::map<RankKey, Entry> entries_;
  std::map<RankKey, RankKey> parent_of_pending_;
  std::map<RankKey, PoolAction> action_of_pending_;
  std::set<int> dead_;
  PoolCounters counters_;
};

}  // namespace nereus
