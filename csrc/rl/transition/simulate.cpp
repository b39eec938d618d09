// The sequential simulation (nereus_rl/transition_simulate.py and transition_holders.py),
// compiled: it orders, funds and anchors the primitives. Every container that Python
// iterates in insertion order is an insertion-ordered list here too.
#include <algorithm>
#include <stdexcept>
#include <unordered_map>

#include "transition/dag.h"

namespace nereus_rl::transition {
namespace {

// Insertion-ordered sets of (unit, state-slot) nodes with O(1) erase and move-to-end:
// the OrderedDicts of transition_holders.Holders.
struct Lists {
  std::vector<int> prev, next;
  explicit Lists(size_t nodes) : prev(nodes, -1), next(nodes, -1) {}
  struct L {
    int head = -1, tail = -1;
  };
  void push(L& l, int x) {
    prev[x] = l.tail;
    next[x] = -1;
    if (l.tail >= 0) {
      next[l.tail] = x;
    } else {
      l.head = x;
    }
    l.tail = x;
  }
  void erase(L& l, int x) {
    if (prev[x] >= 0) {
      next[prev[x]] = next[x];
    } else {
      l.head = next[x];
    }
    if (next[x] >= 0) {
      prev[next[x]] = prev[x];
    } else {
      l.tail = prev[x];
    }
  }
};

using Groups = std::array<Lists::L, 4>;

class Sim {
 public:
  explicit Sim(const Problem& pb) : pb_(pb), src_(pb.units.size() * 2), anc_(pb.units.size() * 2) {}

  Compiled run();

 private:
  const Problem& pb_;
  Compiled out_;
  int n_ = 0, words_ = 0;
  std::vector<double> used_;
  std::vector<int> consumer_, destroy_of_, creator_;
  std::vector<char> final_, live_, done_;
  std::vector<std::array<int8_t, 2>> cat_;
  std::vector<std::vector<int>> model_stages_;
  std::unordered_map<int64_t, int> src_index_;  // (state, stage) -> src group
  std::vector<Groups> src_groups_, anchor_groups_;
  std::vector<int> unit_src_group_;  // per node: its src group
  Lists src_, anc_;
  std::vector<int> slot_;                    // slot key -> unit or -1
  std::vector<int> slot_free_by_;            // slot key -> releasing primitive or -1
  std::vector<std::vector<int>> dev_units_;  // touched live devices -> units
  std::vector<std::vector<std::pair<int, double>>> funds_;
  std::vector<std::vector<int>> in_preds_;
  std::vector<uint64_t> anc_bits_;
  std::vector<int> fund_groups_[3];

  int add_prim(Kind kind, int stage, SmallVec<int, 2> ins, SmallVec<int, 2> outs);
  bool check_memory();
  void edge(int src, int dst, bool data, Why why, int arg, int arg2 = -1);
  bool has_anc(const uint64_t* a, int f) const { return (a[f >> 6] >> (f & 63)) & 1; }
  void or_anc(uint64_t* a, int f) {
    const uint64_t* b = &anc_bits_[size_t(f) * words_];
    for (int w = 0; w < words_; ++w) a[w] |= b[w];
    a[f >> 6] |= uint64_t(1) << (f & 63);
  }
  int src_group(int state, int stage) const {
    auto it = src_index_.find(int64_t(state) * pb_.num_stages + stage);
    return it == src_index_.end() ? -1 : it->second;
  }
  void add_unit(int u, int src_cat, int anchor_cat, bool index);
  void drop(int u);
  int pick_source(int t, bool commit);
  bool anchors(int u, std::vector<std::pair<int, int>>* out);
  bool ready(int p);
  int destroy_for(int owner);
  bool unblock(const std::vector<int>& blocked);
  void run_prim(int p);
  void fund(int p, uint64_t* a_bits, double need, int d);
};

int Sim::add_prim(Kind kind, int stage, SmallVec<int, 2> ins, SmallVec<int, 2> outs) {
  Prim pr;
  pr.kind = kind;
  pr.stage = stage;
  const auto& U = pb_.units;
  for (int u : outs)
    for (int d : U[u].dev) pr.acq.emplace_back(d, U[u].mem);
  for (int u : ins)
    for (int d : U[u].dev)
      if (!pb_.lostdev[d]) pr.rel.emplace_back(d, U[u].mem);
  if (kind == kDestroy)
    for (int d : U[ins[0]].dev) pr.lost = pr.lost || pb_.lostdev[d];
  if (pb_.stage_slots) {  // Primitive.slots_acquired / slots_released
    for (int u : outs)
      for (int d : U[u].dev) {
        bool held = false;
        for (int v : ins) held = held || std::count(U[v].dev.begin(), U[v].dev.end(), d);
        if (!held) pr.slot_acq.push_back(pb_.slot_key(U[u].stage, d));
      }
    for (int u : ins)
      for (int d : U[u].dev) {
        bool kept = false;
        for (int v : outs) kept = kept || std::count(U[v].dev.begin(), U[v].dev.end(), d);
        if (!kept) pr.slot_rel.push_back(pb_.slot_key(U[u].stage, d));
      }
  }
  pr.ins = ins;
  pr.outs = outs;
  out_.prims.push_back(std::move(pr));
  return int(out_.prims.size()) - 1;
}

bool Sim::check_memory() {
  const auto& U = pb_.units;
  used_.assign(pb_.num_devices, 0.0);
  for (int u = 0; u < pb_.num_current; ++u)
    for (int d : U[u].dev)
      if (pb_.exist[d]) used_[d] += U[u].mem;
  for (int d : pb_.exist_order)
    if (used_[d] > pb_.cap[d] + kTol) {
      out_.status = kCurrentOverCapacity;
      return false;
    }
  std::vector<double> tgt(pb_.num_devices, 0.0);
  for (int u : pb_.target_units) {
    bool touches = false;
    for (int d : U[u].dev) touches = touches || pb_.touched[d];
    if (!touches) continue;
    for (int d : U[u].dev)
      if (pb_.touched[d]) tgt[d] += U[u].mem;
  }
  for (int d : pb_.exist_order)
    if (pb_.touched[d] && tgt[d] > pb_.cap[d] + kTol) {
      out_.status = kTargetOverCapacity;
      return false;
    }
  return true;
}

void Sim::edge(int src, int dst, bool data, Why why, int arg, int arg2) {
  auto& preds = in_preds_[dst];  // few per primitive: a scan beats a hash set
  if (std::find(preds.begin(), preds.end(), src) != preds.end()) return;
  out_.sim.edges.push_back(Edge{src, dst, data, why, arg, arg2});
  in_preds_[dst].push_back(src);
}

void Sim::add_unit(int u, int src_cat, int anchor_cat, bool index) {
  const Unit& x = pb_.units[u];
  live_[u] = 1;
  cat_[u] = {int8_t(src_cat), int8_t(anchor_cat)};
  for (int k = 0; k < x.num_states; ++k) {
    int s = x.state[k];
    int g = src_group(s, x.stage);
    if (g < 0) {
      g = int(src_groups_.size());
      src_groups_.emplace_back();
      src_index_[int64_t(s) * pb_.num_stages + x.stage] = g;
    }
    unit_src_group_[u * 2 + k] = g;
    src_.push(src_groups_[g][src_cat], u * 2 + k);
    anc_.push(anchor_groups_[s][anchor_cat], u * 2 + k);
  }
  if (!index) return;
  for (int d : x.dev) {
    slot_[pb_.slot_key(x.stage, d)] = u;
    if (pb_.touched[d] && !pb_.lostdev[d]) dev_units_[d].push_back(u);
  }
}

void Sim::drop(int u) {
  const Unit& x = pb_.units[u];
  live_[u] = 0;
  for (int k = 0; k < x.num_states; ++k) {
    src_.erase(src_groups_[unit_src_group_[u * 2 + k]][cat_[u][0]], u * 2 + k);
    anc_.erase(anchor_groups_[x.state[k]][cat_[u][1]], u * 2 + k);
  }
  for (int d : x.dev) {
    int key = pb_.slot_key(x.stage, d);
    if (slot_[key] == u) slot_[key] = -1;
    if (pb_.touched[d] && !pb_.lostdev[d]) {
      auto& du = dev_units_[d];
      auto it = std::find(du.begin(), du.end(), u);
      if (it != du.end()) du.erase(it);
    }
  }
}

int Sim::pick_source(int t, bool commit) {
  const Unit& x = pb_.units[t];
  int key = x.trains ? pb_.num_models + x.stage : x.model;
  int stages_buf[1] = {x.stage};
  const std::vector<int>* ms = x.trains ? nullptr : &model_stages_[x.model];
  for (int c = 0; c < 4; ++c) {
    // stages: the unit's own first, then the model's other stages in rank order
    int count = ms ? 1 + int(ms->size()) : 1;
    for (int i = 0; i < count; ++i) {
      int st = i == 0 ? stages_buf[0] : (*ms)[i - 1];
      if (i > 0 && st == x.stage) continue;
      int g = src_group(key, st);
      if (g < 0) continue;
      auto& l = src_groups_[g][c];
      if (l.head < 0) continue;
      int node = l.head;
      if (commit) {
        src_.erase(l, node);
        src_.push(l, node);
      }
      return node / 2;
    }
  }
  return -1;
}

bool Sim::anchors(int u, std::vector<std::pair<int, int>>* out) {
  const Unit& x = pb_.units[u];
  for (int k = 0; k < x.num_states; ++k) {
    int s = x.state[k], best = -1;
    for (int c = 0; c < 4 && best < 0; ++c)
      for (int node = anchor_groups_[s][c].head; node >= 0; node = anc_.next[node])
        if (node / 2 != u) {
          best = node / 2;
          break;
        }
    if (best < 0) return false;
    if (out) out->emplace_back(s, best);
  }
  return true;
}

bool Sim::ready(int p) {
  const Prim& pr = out_.prims[p];
  for (auto [d, a] : pr.acq)
    if (used_[d] + a > pb_.cap[d] + kTol) return false;
  for (int s : pr.slot_acq)
    if (slot_[s] >= 0) return false;
  if (pr.kind == kMerge) {
    for (int u : pr.ins)
      if (!live_[u]) return false;
    return true;
  }
  if (pr.kind == kExtend) return pick_source(pr.outs[0], false) >= 0;
  return true;
}

int Sim::destroy_for(int owner) {
  int q = destroy_of_[owner];
  if (q < 0 || done_[q] || !anchors(out_.prims[q].ins[0], nullptr)) return -1;
  return q;
}

bool Sim::unblock(const std::vector<int>& blocked) {
  bool ran = false;
  auto& P = out_.prims;
  for (int p : blocked) {
    for (int s : P[p].slot_acq) {
      int owner = slot_[s];
      int q = owner >= 0 ? destroy_for(owner) : -1;
      if (q >= 0) {
        out_.early.emplace_back(q, p);
        run_prim(q);
        ran = true;
      }
    }
    for (auto [d, a] : P[p].acq) {
      while (used_[d] + a > pb_.cap[d] + kTol) {
        std::vector<std::pair<int, int>> cands;
        for (int u : dev_units_[d]) {
          int q = destroy_of_[u];
          if (q >= 0 && !done_[q]) cands.emplace_back(P[q].stage, q);
        }
        std::sort(cands.begin(), cands.end());
        int pick = -1;
        for (auto [r, q] : cands)
          if (anchors(P[q].ins[0], nullptr)) {
            pick = q;
            break;
          }
        if (pick < 0) break;
        out_.early.emplace_back(pick, p);
        run_prim(pick);
        ran = true;
      }
    }
  }
  if (ran) return true;
  std::vector<std::pair<int, int>> all;
  for (int u : pb_.destroys) all.emplace_back(P[destroy_of_[u]].stage, destroy_of_[u]);
  std::sort(all.begin(), all.end());
  for (auto [r, q] : all)
    if (!done_[q] && anchors(P[q].ins[0], nullptr)) {
      out_.early.emplace_back(q, -1);
      run_prim(q);
      return true;
    }
  out_.status = kBlocked;
  return false;
}

// transition_refine.fund_acquisition on this simulation's funds.
void Sim::fund(int p, uint64_t* a_bits, double need, int d) {
  if (need <= kTol) return;
  auto& entries = funds_[d];
  auto& groups = fund_groups_;
  for (auto& g : groups) g.clear();
  for (int i = 0; i < int(entries.size()); ++i) {
    if (entries[i].second > kTol) {
      int f = entries[i].first;
      groups[f == -1 ? 0 : has_anc(a_bits, f) ? 1 : 2].push_back(i);
    }
  }
  for (auto& g : groups)
    for (int i : g) {
      auto& e = entries[i];
      int f = e.first;
      double rem = e.second, take = std::min(rem, need);
      e.second = rem - take;
      need -= take;
      out_.sim.funding.push_back(Funding{p, d, false, f, take});
      if (f != -1 && !has_anc(a_bits, f)) {
        edge(f, p, false, kRbaDevice, d);
        or_anc(a_bits, f);
      }
      if (need <= kTol) {
        entries.erase(std::remove_if(entries.begin(), entries.end(),
                                     [](const auto& x) { return !(x.second > kTol); }),
                      entries.end());
        return;
      }
    }
  throw std::logic_error("device unfunded though it had room");
}

void Sim::run_prim(int p) {
  Prim& pr = out_.prims[p];
  const auto& U = pb_.units;
  if (pr.kind == kExtend) {
    int src = pick_source(pr.outs[0], true);
    pr.source = src;
    if (creator_[src] >= 0) edge(creator_[src], p, true, kCreatedBeforeCopy, src);
    if (destroy_of_[src] >= 0) edge(p, destroy_of_[src], true, kLivesUntilCopied, src);
    if (consumer_[src] >= 0) edge(p, consumer_[src], true, kLivesUntilCopied, src);
  } else if (pr.kind == kMerge) {
    for (int u : pr.ins)
      if (creator_[u] >= 0) edge(creator_[u], p, true, kCreatedBeforeMerge, u);
  } else if (pr.kind == kDestroy && !pr.lost) {
    std::vector<std::pair<int, int>> anchors_of;
    anchors(pr.ins[0], &anchors_of);
    for (auto [s, holder] : anchors_of) {
      out_.anchors.push_back({p, s, holder});
      if (creator_[holder] >= 0) {
        edge(creator_[holder], p, true, kHolds, holder, s);
      } else if (destroy_of_[holder] >= 0) {
        edge(p, destroy_of_[holder], true, kHolds, holder, s);
      }
    }
  }
  uint64_t* a = &anc_bits_[size_t(p) * words_];
  for (int q : in_preds_[p]) or_anc(a, q);
  for (auto [d, amount] : pr.acq) {
    if (amount > kTol) {
      auto& entries = funds_[d];
      if (!entries.empty() && entries[0].first == -1 && entries[0].second >= amount) {
        entries[0].second -= amount;  // free from the start
        out_.sim.funding.push_back(Funding{p, d, false, -1, amount});
      } else {
        fund(p, a, amount, d);
      }
    }
    used_[d] += amount;
  }
  for (int s : pr.slot_acq) {
    int f = slot_free_by_[s];
    slot_free_by_[s] = -1;
    out_.sim.funding.push_back(Funding{p, s, true, f, 1.0});
    if (f != -1 && !has_anc(a, f)) {
      edge(f, p, false, kRbaSlot, s);
      or_anc(a, f);
    }
  }
  for (int u : pr.ins)
    if (live_[u]) drop(u);
  for (int u : pr.outs) {
    creator_[u] = p;
    bool consumed = consumer_[u] >= 0;
    add_unit(u, consumed ? 3 : 2, final_[u] ? 1 : consumed ? 2 : 3, true);
  }
  for (auto [d, r] : pr.rel) {
    used_[d] -= r;
    funds_[d].emplace_back(p, r);
  }
  for (int s : pr.slot_rel) slot_free_by_[s] = p;
  out_.sim.order.push_back(p);
  done_[p] = 1;
  (void)U;
}

Compiled Sim::run() {
  const auto& U = pb_.units;
  const int nu = int(U.size());
  if (!check_memory()) return std::move(out_);
  consumer_.assign(nu, -1);
  destroy_of_.assign(nu, -1);
  creator_.assign(nu, -1);
  std::vector<int> lost_pids, acq;
  out_.prims.reserve(pb_.lost_units.size() + pb_.splits.size() + 2 * pb_.relayouts.size() +
                     pb_.merges.size() + pb_.extends.size() + pb_.destroys.size());
  for (int u : pb_.lost_units) lost_pids.push_back(add_prim(kDestroy, U[u].stage, {u}, {}));
  for (auto [u, a, b] : pb_.splits) {
    acq.push_back(add_prim(kSplit, U[u].stage, {u}, {a, b}));
    consumer_[u] = acq.back();
  }
  for (auto [u, a, b, t] : pb_.relayouts) {
    int s = add_prim(kSplit, U[u].stage, {u}, {a, b});
    int m = add_prim(kMerge, U[u].stage, {a, b}, {t});
    acq.push_back(s);
    acq.push_back(m);
    consumer_[u] = s;
    consumer_[a] = consumer_[b] = m;
  }
  for (auto [a, b, t] : pb_.merges) {
    acq.push_back(add_prim(kMerge, U[t].stage, {a, b}, {t}));
    consumer_[a] = consumer_[b] = acq.back();
  }
  for (int t : pb_.extends) acq.push_back(add_prim(kExtend, U[t].stage, {}, {t}));
  for (int u : pb_.destroys) destroy_of_[u] = add_prim(kDestroy, U[u].stage, {u}, {});
  auto& P = out_.prims;
  static constexpr int kKindRank[4] = {2, 9, 0, 1};  // split, merge, extend
  std::stable_sort(acq.begin(), acq.end(), [&](int x, int y) {
    if (P[x].stage != P[y].stage) return P[x].stage < P[y].stage;
    if (P[x].kind != P[y].kind) return kKindRank[P[x].kind] < kKindRank[P[y].kind];
    return x < y;
  });

  n_ = int(P.size());
  words_ = (n_ + 63) / 64;
  in_preds_.assign(n_, {});
  anc_bits_.assign(size_t(n_) * words_ + 1, 0);
  done_.assign(n_, 0);
  // Per model, its stages (current units, then target units) in rank order.
  model_stages_.assign(pb_.num_models, {});
  auto add_pair = [&](int u) {
    auto& ms = model_stages_[U[u].model];
    if (std::find(ms.begin(), ms.end(), U[u].stage) == ms.end()) ms.push_back(U[u].stage);
  };
  for (int u = 0; u < pb_.num_current; ++u) add_pair(u);
  for (int u : pb_.target_units) add_pair(u);
  for (auto& ms : model_stages_) std::sort(ms.begin(), ms.end());
  funds_.assign(pb_.num_devices, {});
  for (int d = 0; d < pb_.num_devices; ++d)
    if (pb_.touched[d] && pb_.exist[d]) funds_[d].emplace_back(-1, pb_.cap[d] - used_[d]);
  final_.assign(nu, 0);
  for (int u : pb_.target_units) final_[u] = 1;
  live_.assign(nu, 0);
  cat_.assign(nu, {0, 0});
  unit_src_group_.assign(size_t(nu) * 2, -1);
  anchor_groups_.assign(pb_.num_models + pb_.num_stages, Groups{});
  slot_.assign(size_t(pb_.num_stages) * pb_.num_devices, -1);
  slot_free_by_.assign(size_t(pb_.num_stages) * pb_.num_devices, -1);
  dev_units_.assign(pb_.num_devices, {});
  std::vector<char> is_lost(nu, 0);
  for (int u : pb_.lost_units) is_lost[u] = 1;
  for (int u = 0; u < pb_.num_current; ++u) {
    if (is_lost[u]) continue;
    int src_cat = consumer_[u] >= 0 ? 1 : 0;
    int anchor_cat = final_[u] ? 0 : src_cat ? 2 : 3;
    bool touches = false;
    for (int d : U[u].dev) touches = touches || pb_.touched[d];
    add_unit(u, src_cat, anchor_cat, touches);
  }

  for (int p : lost_pids) run_prim(p);
  std::vector<int> pending = std::move(acq), blocked;
  while (!pending.empty()) {
    blocked.clear();
    for (int p : pending) {
      if (ready(p)) {
        run_prim(p);
      } else {
        blocked.push_back(p);
      }
    }
    if (blocked.size() == pending.size() && !unblock(blocked)) return std::move(out_);
    pending.swap(blocked);
  }
  std::vector<std::pair<int, int>> rest;
  for (int u : pb_.destroys) rest.emplace_back(P[destroy_of_[u]].stage, destroy_of_[u]);
  std::sort(rest.begin(), rest.end());
  for (auto [r, q] : rest)
    if (!done_[q]) run_prim(q);
  return std::move(out_);
}

}  // namespace

Compiled simulate(const Problem& pb) { return Sim(pb).run(); }

}  // namespace nereus_rl::transition
