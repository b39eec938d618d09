#include "pool/pool_core.h"

#include <algorithm>
#include <cassert>
#include <sstream>

#include "common.h"

namespace nereus {
namespace {

std::string key_str(const RankKey& key) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < key.size(); ++i) os << (i ? ", " : "") << key[i];
  os << (key.size() == 1 ? ",)" : ")");
  return os.str();
}

bool covers(const RankKey& parent, const std::set<int>& wanted) {
  size_t found = 0;
  for (int r : parent) found += wanted.count(r);
  return found == wanted.size();
}

// Smaller first, then key order: the tie-break every process agrees on.
bool smaller(const RankKey& a, const RankKey& b) {
  return a.size() != b.size() ? a.size() < b.size() : a < b;
}

}  // namespace

const char* pool_action_name(PoolAction action) {
  switch (action) {
    case PoolAction::kHit:
      return "hit";
    case PoolAction::kSplit:
      return "split";
    case PoolAction::kShrink:
      return "shrink";
    case PoolAction::kGrow:
      return "grow";
    case PoolAction::kInit:
      return "init";
  }
  return "?";
}

PoolCore::PoolCore(int64_t capacity, bool can_split, bool can_shrink, bool can_grow)
    : capacity_(capacity), can_split_(can_split), can_shrink_(can_shrink), can_grow_(can_grow) {
  NEREUS_CHECK(capacity >= 1, "the pool's capacity is " << capacity << "; give at least 1");
}

void PoolCore::check_request(const RankKey& ranks) const {
  NEREUS_CHECK(!ranks.empty(), "a communicator needs at least one rank; got an empty rank tuple");
  std::set<int> seen;
  for (int r : ranks) {
    NEREUS_CHECK(r >= 0, "rank " << r << " in " << key_str(ranks) << " is negative");
    NEREUS_CHECK(seen.insert(r).second,
                 "rank " << r << " appears twice in " << key_str(ranks) << "; list each rank once");
    NEREUS_CHECK(!dead_.count(r), "rank " << r << " in " << key_str(ranks)
                                          << " was reported lost; request the surviving ranks");
  }
}

PoolDecision PoolCore::acquire(const RankKey& ranks) {
  check_request(ranks);
  PoolDecision d;
  d.key = ranks;
  auto it = entries_.find(ranks);
  if (it != entries_.end()) {
    NEREUS_CHECK(!it->second.pending,
                 "the communicator for " << key_str(ranks) << " is still being created");
    // A cached key never holds a dead rank (check_request), so it is healthy.
    it->second.pins += 1;
    it->second.last_used = ++tick_;
    counters_.hits += 1;
    d.action = PoolAction::kHit;
    d.handle = it->second.handle;
    return d;
  }
  counters_.misses += 1;
  const std::set<int> wanted(ranks.begin(), ranks.end());
  const RankKey* best = nullptr;
  PoolAction action = PoolAction::kInit;

  // Shrink: a broken communicator whose survivors, in order, are the request.
  if (can_shrink_) {
    for (const auto& [key, e] : entries_) {
      if (!e.broken || e.pending) continue;
      RankKey survivors;
      for (int r : key)
        if (!dead_.count(r)) survivors.push_back(r);
      if (survivors == ranks && (!best || smaller(key, *best))) best = &key;
    }
    if (best) action = PoolAction::kShrink;
  }
  // Split: the smallest healthy communicator that holds every requested rank.
  if (!best && can_split_) {
    for (const auto& [key, e] : entries_) {
      if (e.broken || e.pending || !covers(key, wanted)) continue;
      if (!best || smaller(key, *best)) best = &key;
    }
    if (best) action = PoolAction::kSplit;
  }
  // Grow: the largest healthy communicator that is a strict prefix of the
  // request (grown ranks are appended after the existing ones).
  if (!best && can_grow_) {
    for (const auto& [key, e] : entries_) {
      if (e.broken || e.pending || key.size() >= ranks.size()) continue;
      if (!std::equal(key.begin(), key.end(), ranks.begin())) continue;
      if (!best || key.size() > best->size()) best = &key;
    }
    if (best) action = PoolAction::kGrow;
  }

  d.action = action;
  if (best) {
    Entry& parent = entries_.at(*best);
    parent.pins += 1;  // keep it from eviction while the child is made
    parent.last_used = ++tick_;
    d.parent = *best;
    d.parent_handle = parent.handle;
    parent_of_pending_[ranks] = *best;
  }
  action_of_pending_[ranks] = action;
  Entry pending;
  pending.pending = true;
  entries_[ranks] = pending;
  return d;
}

PoolCore::Entry& PoolCore::pending_entry(const RankKey& ranks) {
  auto it = entries_.find(ranks);
  NEREUS_CHECK(it != entries_.end() && it->second.pending,
               "no creation of " << key_str(ranks) << " is pending; call acquire() first");
  return it->second;
}

void PoolCore::unpin_parent(const RankKey& ranks) {
  auto p = parent_of_pending_.find(ranks);
  if (p == parent_of_pending_.end()) return;
  auto it = entries_.find(p->second);
  assert(it != entries_.end() && it->second.pins > 0);
  it->second.pins -= 1;
  parent_of_pending_.erase(p);
}

std::vector<PoolDisposal> PoolCore::commit(const RankKey& ranks, int64_t handle, double seconds) {
  Entry& e = pending_entry(ranks);
  NEREUS_CHECK(seconds >= 0.0, "creation seconds must be >= 0; got " << seconds);
  e.pending = false;
  e.handle = handle;
  e.pins = 1;
  e.last_used = ++tick_;
  counters_.create_seconds += seconds;
  const PoolAction action = action_of_pending_.at(ranks);
  action_of_pending_.erase(ranks);
  switch (action) {
    case PoolAction::kSplit:
      counters_.splits += 1;
      break;
    case PoolAction::kShrink:
      counters_.shrinks += 1;
      break;
    case PoolAction::kGrow:
      counters_.grows += 1;
      break;
    default:
      counters_.inits += 1;
  }
  std::vector<PoolDisposal> out;
  if (action == PoolAction::kShrink) {
    // The broken source has served its purpose: free it now unless a caller
    // still holds it (then eviction frees it after release, broken first).
    const RankKey parent = parent_of_pending_.at(ranks);
    unpin_parent(ranks);
    auto it = entries_.find(parent);
    if (it->second.pins == 0) {
      out.push_back({parent, it->second.handle, true});
      entries_.erase(it);
    }
  } else {
    unpin_parent(ranks);
  }
  auto evicted = evict_over_capacity();
  out.insert(out.end(), evicted.begin(), evicted.end());
  return out;
}

void PoolCore::abort(const RankKey& ranks) {
  pending_entry(ranks);
  unpin_parent(ranks);
  action_of_pending_.erase(ranks);
  entries_.erase(ranks);
  counters_.failures += 1;
}

std::vector<PoolDisposal> PoolCore::release(const RankKey& ranks) {
  auto it = entries_.find(ranks);
  NEREUS_CHECK(it != entries_.end() && !it->second.pending && it->second.pins > 0,
               "the communicator for " << key_str(ranks)
                                       << " is not held; release only what get() returned");
  it->second.pins -= 1;
  return evict_over_capacity();
}

std::vector<PoolDisposal> PoolCore::evict_over_capacity() {
  std::vector<PoolDisposal> out;
  while (size() > capacity_) {
    // Broken entries go first (only a shrink could still use them), then the
    // least recently used healthy one; pinned and pending ones never.
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      const Entry& e = it->second;
      if (e.pins > 0 || e.pending) continue;
      if (victim == entries_.end()) {
        victim = it;
        continue;
      }
      const Entry& v = victim->second;
      if (e.broken != v.broken ? e.broken : e.last_used < v.last_used) victim = it;
    }
    if (victim == entries_.end()) break;  // all pinned: over capacity until released
    out.push_back({victim->first, victim->second.handle, victim->second.broken});
    entries_.erase(victim);
    counters_.evictions += 1;
  }
  return out;
}

std::vector<RankKey> PoolCore::mark_lost(const std::vector<int>& dead) {
  for (int r : dead) {
    NEREUS_CHECK(r >= 0, "lost rank " << r << " is negative");
    dead_.insert(r);
  }
  std::vector<RankKey> broken;
  for (auto& [key, e] : entries_) {
    if (e.broken) continue;
    for (int r : key) {
      if (dead_.count(r)) {
        e.broken = true;
        broken.push_back(key);
        break;
      }
    }
  }
  return broken;
}

std::vector<PoolDisposal> PoolCore::clear() {
  std::vector<PoolDisposal> out;
  for (const auto& [key, e] : entries_)
    if (!e.pending) out.push_back({key, e.handle, e.broken});
  entries_.clear();
  parent_of_pending_.clear();
  action_of_pending_.clear();
  dead_.clear();  // a cleared pool starts over, e.g. in a new generation's rank space
  return out;
}

std::vector<RankKey> PoolCore::lru_order() const {
  std::vector<std::pair<uint64_t, RankKey>> order;
  for (const auto& [key, e] : entries_)
    if (!e.pending) order.emplace_back(e.last_used, key);
  std::sort(order.begin(), order.end());
  std::vector<RankKey> out;
  for (auto& [tick, key] : order) out.push_back(key);
  return out;
}

int64_t PoolCore::pins(const RankKey& ranks) const {
  auto it = entries_.find(ranks);
  return it == entries_.end() ? 0 : it->second.pins;
}

bool PoolCore::is_broken(const RankKey& ranks) const {
  auto it = entries_.find(ranks);
  return it != entries_.end() && it->second.broken;
}

}  // namespace nereus
