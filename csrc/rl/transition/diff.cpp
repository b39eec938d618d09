// The plan diff (nereus_rl/transition_diff.py), compiled: which current units stay,
// split, merge, re-lay-out, extend or go. Python dicts are emulated where their
// semantics matter (a key keeps its first position and its last value).
#include "transition/diff.h"

#include <algorithm>

namespace nereus_rl::transition {
namespace {

uint64_t mix(uint64_t h, uint64_t x) {
  x *= 0x9E3779B97F4A7C15ull;
  return (h ^ (x >> 29) ^ x) * 0xBF58476D1CE4E5B9ull;
}

// A dict keyed by int sequences: a slot per key in first-insertion order holding the
// last value put (Python dict semantics), open addressing over a flat key pool so that
// no key costs an allocation. Sized for `expected` keys.
class SeqDict {
 public:
  explicit SeqDict(size_t expected) {
    size_t cap = 16;
    while (cap < 2 * expected + 2) cap <<= 1;
    table_.assign(cap, -1);
    mask_ = cap - 1;
  }
  int get(const std::vector<int>& key) const {
    int s = find(key, hash(key));
    return s < 0 || !alive_[s] ? -1 : value_[s];
  }
  bool contains(const std::vector<int>& key) const { return get(key) >= 0; }
  void put(const std::vector<int>& key, int value) {
    uint64_t h = hash(key);
    int s = find(key, h);
    if (s >= 0 && alive_[s]) {
      value_[s] = value;
      return;
    }
    // Puts come before pops here, so a key is never put again after a pop.
    s = int(value_.size());
    off_.push_back(int(pool_.size()));
    len_.push_back(int(key.size()));
    pool_.insert(pool_.end(), key.begin(), key.end());
    value_.push_back(value);
    alive_.push_back(1);
    size_t i = h & mask_;
    while (table_[i] >= 0) i = (i + 1) & mask_;
    table_[i] = s;
    ++size_;
  }
  int pop(const std::vector<int>& key) {  // the value, or -1
    int s = find(key, hash(key));
    if (s < 0 || !alive_[s]) return -1;
    alive_[s] = 0;
    --size_;
    return value_[s];
  }
  int size() const { return size_; }
  std::vector<int> values() const {
    std::vector<int> out;
    for (size_t s = 0; s < value_.size(); ++s)
      if (alive_[s]) out.push_back(value_[s]);
    return out;
  }

 private:
  static uint64_t hash(const std::vector<int>& k) {
    uint64_t h = k.size();
    for (int x : k) h = mix(h, uint64_t(uint32_t(x)));
    return h ^ (h >> 31);
  }
  int find(const std::vector<int>& key, uint64_t h) const {
    for (size_t i = h & mask_; table_[i] >= 0; i = (i + 1) & mask_) {
      int s = table_[i];
      if (len_[s] == int(key.size()) && std::equal(key.begin(), key.end(), pool_.begin() + off_[s]))
        return s;
    }
    return -1;
  }
  std::vector<int> table_, pool_, off_, len_, value_;
  std::vector<char> alive_;
  size_t mask_;
  int size_ = 0;
};

}  // namespace

DiffResult diff_plans(Problem& pb, const std::vector<TargetStage>& target,
                      const std::vector<int64_t>& dev_id,
                      const std::function<bool(int, int)>& taken) {
  DiffResult r;
  auto& U = pb.units;
  const int ncur = pb.num_current;
  auto is_lost = [&](int u) {
    for (int d : U[u].dev)
      if (pb.lostdev[d]) return true;
    return false;
  };
  std::vector<int> alive;
  for (int u = 0; u < ncur; ++u) {
    if (is_lost(u)) {
      pb.lost_units.push_back(u);
    } else {
      alive.push_back(u);
    }
  }
  // Every state survives: held by a live unit now, and by some target unit.
  const int num_states = pb.num_models + pb.num_stages;
  std::vector<char> in_target(num_states, 0), in_alive(num_states, 0);
  for (const TargetStage& sp : target) {
    in_target[sp.model] = 1;
    if (sp.trains) in_target[pb.num_models + sp.stage] = 1;
  }
  for (int u : alive) {
    in_alive[U[u].model] = 1;
    if (U[u].trains) in_alive[pb.num_models + U[u].stage] = 1;
  }
  for (int u = 0; u < ncur; ++u)
    if (!in_target[U[u].model] || (U[u].trains && !in_target[pb.num_models + U[u].stage])) {
      r.status = kStateLoss;
      return r;
    }
  for (const TargetStage& sp : target)
    if (!in_alive[sp.model] || (sp.trains && !in_alive[pb.num_models + sp.stage])) {
      r.status = kStateLoss;
      return r;
    }

  std::vector<std::vector<int>> by_stage(pb.num_stages);
  std::vector<int> stage_seen;  // stages of alive units, first appearance
  for (int u : alive) {
    if (by_stage[U[u].stage].empty()) stage_seen.push_back(U[u].stage);
    by_stage[U[u].stage].push_back(u);
  }
  size_t created = 0;  // at most one per target unit, two per relayout
  for (const TargetStage& sp : target) created += 3 * sp.units.size();
  U.reserve(U.size() + created);
  std::vector<char> popped(pb.num_stages, 0);
  std::vector<int> merges_t;  // merge targets, in order (for the creation order)
  std::vector<int> dev_map(pb.num_devices, -1);
  std::vector<int> whole, rest, bs;  // _halves' scratch, reused
  auto new_unit = [&](const Unit& like) {
    U.push_back(like);
    return int(U.size()) - 1;
  };
  for (int si = 0; si < int(target.size()); ++si) {
    const TargetStage& sp = target[si];
    std::vector<int> rem;
    if (!popped[sp.stage]) rem = by_stage[sp.stage];
    popped[sp.stage] = 1;
    SeqDict by_layout(rem.size());
    std::vector<int> key;
    auto layout_key = [&](int tp, int pp, const auto& dev) -> const std::vector<int>& {
      key.assign({tp, pp});
      key.insert(key.end(), dev.begin(), dev.end());
      return key;
    };
    for (int u : rem) by_layout.put(layout_key(U[u].tp, U[u].pp, U[u].dev), u);
    const bool distinct = by_layout.size() == int(rem.size());
    std::vector<int> todo;
    for (int j = 0; j < int(sp.units.size()); ++j) {
      int f = by_layout.pop(layout_key(sp.tp, sp.pp, sp.units[j]));
      if (f >= 0) {
        r.kept.push_back(f);
        pb.target_units.push_back(f);
      } else {
        todo.push_back(j);
      }
    }
    if (distinct) {
      rem = by_layout.values();
    } else {
      std::vector<int> keep;
      for (int u : rem)
        if (by_layout.contains(layout_key(U[u].tp, U[u].pp, U[u].dev))) keep.push_back(u);
      rem.swap(keep);
    }
    // New units are "<stage>#<k>" for the smallest k no current unit uses.
    std::vector<int> fresh;
    int k = 0;
    for (int j : todo) {
      while (taken(sp.stage, k)) ++k;
      Unit t;
      t.stage = sp.stage;
      t.model = sp.model;
      t.trains = sp.trains;
      t.tp = sp.tp;
      t.pp = sp.pp;
      t.dev.assign(sp.units[j].begin(), sp.units[j].end());
      int id = new_unit(t);
      r.origin.push_back({id, Origin::kTarget, si, j, k});
      fresh.push_back(id);
      pb.target_units.push_back(id);
      ++k;
    }
    // Relayout in place: same device set, other layout.
    if (!rem.empty()) {
      SeqDict by_set(rem.size());
      auto set_key = [&](const Devs& dev) -> const std::vector<int>& {
        key.assign(dev.begin(), dev.end());
        std::sort(key.begin(), key.end());
        key.erase(std::unique(key.begin(), key.end()), key.end());
        return key;
      };
      for (int u : rem) by_set.put(set_key(U[u].dev), u);
      std::vector<int> left;
      for (int t : fresh) {
        int u = by_set.get(set_key(U[t].dev));
        if (u >= 0 && U[u].dev.size() % 2 == 0) {
          by_set.pop(set_key(U[u].dev));
          Unit h = U[u];
          if (h.tp % 2 == 0) {
            h.tp /= 2;
          } else {
            h.pp /= 2;
          }
          size_t half = U[u].dev.size() / 2;
          h.dev.assign(U[u].dev.begin(), U[u].dev.begin() + half);
          int ha = new_unit(h);
          h.dev.assign(U[u].dev.begin() + half, U[u].dev.end());
          int hb = new_unit(h);
          r.origin.push_back({ha, Origin::kHalfA, u, 0, 0});
          r.origin.push_back({hb, Origin::kHalfB, u, 0, 0});
          pb.relayouts.push_back({u, ha, hb, t});
        } else {
          left.push_back(t);
        }
      }
      rem = by_set.values();
      fresh.swap(left);
    }
    // _halves: the two units of by_dev whose devices are exactly dev, half each.
    auto halves = [&](const Devs& dev, int* a_out, int* b_out) {
      whole.assign(dev.begin(), dev.end());
      std::sort(whole.begin(), whole.end());
      whole.erase(std::unique(whole.begin(), whole.end()), whole.end());
      auto in_whole = [&](int d) { return std::binary_search(whole.begin(), whole.end(), d); };
      int a = dev_map[dev[0]];
      if (a < 0 || 2 * U[a].dev.size() != whole.size()) return false;
      for (int d : U[a].dev)
        if (!in_whole(d)) return false;
      rest.clear();
      for (int d : whole)
        if (std::find(U[a].dev.begin(), U[a].dev.end(), d) == U[a].dev.end()) rest.push_back(d);
      if (rest.empty()) return false;
      int lo = *std::min_element(rest.begin(), rest.end(),
                                 [&](int x, int y) { return dev_id[x] < dev_id[y]; });
      int b = dev_map[lo];
      if (b < 0) return false;
      bs.assign(U[b].dev.begin(), U[b].dev.end());
      std::sort(bs.begin(), bs.end());
      bs.erase(std::unique(bs.begin(), bs.end()), bs.end());
      if (bs != rest) return false;
      *a_out = a;
      *b_out = b;
      return true;
    };
    const size_t size = size_t(sp.tp) * sp.pp;
    bool any = false;
    for (int u : rem) any = any || 2 * U[u].dev.size() == size;
    if (!fresh.empty() && any) {
      std::vector<int> used_keys;
      for (int u : rem)
        for (int d : U[u].dev) dev_map[d] = u, used_keys.push_back(d);
      std::vector<int> left;
      for (int t : fresh) {
        int a, b;
        if (!halves(U[t].dev, &a, &b)) {
          left.push_back(t);
          continue;
        }
        pb.merges.push_back({a, b, t});
        merges_t.push_back(t);
        for (int d : U[t].dev) dev_map[d] = -1;
      }
      fresh.swap(left);
      std::vector<int> keep;
      for (int u : rem)
        if (dev_map[U[u].dev[0]] >= 0) keep.push_back(u);
      rem.swap(keep);
      for (int d : used_keys) dev_map[d] = -1;
    }
    any = false;
    for (int u : rem) any = any || U[u].dev.size() >= 2 * size;
    if (!fresh.empty() && any) {
      std::vector<int> used_keys;
      for (int t : fresh)
        for (int d : U[t].dev) dev_map[d] = t, used_keys.push_back(d);
      for (int u : rem) {
        int a, b;
        if (!halves(U[u].dev, &a, &b)) {
          pb.destroys.push_back(u);
          continue;
        }
        pb.splits.push_back({u, a, b});
        for (int d : U[u].dev) dev_map[d] = -1;
      }
      for (int t : fresh)
        if (dev_map[U[t].dev[0]] >= 0) pb.extends.push_back(t);
      for (int d : used_keys) dev_map[d] = -1;
    } else {
      pb.extends.insert(pb.extends.end(), fresh.begin(), fresh.end());
      pb.destroys.insert(pb.destroys.end(), rem.begin(), rem.end());
    }
  }
  for (int st : stage_seen)  // stages the target drops
    if (!popped[st])
      pb.destroys.insert(pb.destroys.end(), by_stage[st].begin(), by_stage[st].end());
  // The order the Python compiler asks unit_memory in: current, then created units.
  r.memory_order.resize(ncur);
  for (int u = 0; u < ncur; ++u) r.memory_order[u] = u;
  auto& mo = r.memory_order;
  mo.insert(mo.end(), pb.extends.begin(), pb.extends.end());
  mo.insert(mo.end(), merges_t.begin(), merges_t.end());
  for (auto& s : pb.splits) mo.push_back(s[1]), mo.push_back(s[2]);
  for (auto& s : pb.relayouts) mo.push_back(s[1]), mo.push_back(s[2]), mo.push_back(s[3]);
  return r;
}

}  // namespace nereus_rl::transition
