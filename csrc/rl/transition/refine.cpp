// Critical paths, the makespan lower bound and the list-schedule refinement
// (nereus_rl/transition_paths.py, transition_refine.py and transition_compile._refine),
// compiled with the same iteration orders and float operations as the Python.
#include <algorithm>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "transition/dag.h"

namespace nereus_rl::transition {
namespace {

struct Bits {
  int words;
  std::vector<uint64_t> v;
  Bits(int n) : words((n + 63) / 64), v(size_t(n) * words + 1, 0) {}
  uint64_t* row(int p) { return &v[size_t(p) * words]; }
  static bool has(const uint64_t* a, int f) { return (a[f >> 6] >> (f & 63)) & 1; }
  void add(uint64_t* a, int f) {
    const uint64_t* b = row(f);
    for (int w = 0; w < words; ++w) a[w] |= b[w];
    a[f >> 6] |= uint64_t(1) << (f & 63);
  }
};

// transition_paths.topo_order: the DAG's own order when it is topological, else Kahn's
// algorithm with the order's positions as the tie-break.
std::vector<int> topo_order(int n, const Dag& dag) {
  if (int(dag.order.size()) == n) {
    std::vector<int> pos(n, -1);
    for (int i = 0; i < n; ++i)
      if (dag.order[i] >= 0 && dag.order[i] < n) pos[dag.order[i]] = i;
    bool ok = std::find(pos.begin(), pos.end(), -1) == pos.end();
    for (const Edge& e : dag.edges) ok = ok && pos[e.src] < pos[e.dst];
    if (ok) return dag.order;
  }
  std::vector<int> rank(n);
  for (int i = 0; i < n; ++i) rank[i] = i;
  if (int(dag.order.size()) == n)
    for (int i = 0; i < n; ++i) rank[dag.order[i]] = i;
  std::vector<std::vector<int>> succs(n);
  std::vector<int> indeg(n, 0);
  for (const Edge& e : dag.edges) {
    succs[e.src].push_back(e.dst);
    ++indeg[e.dst];
  }
  std::priority_queue<std::pair<int, int>, std::vector<std::pair<int, int>>, std::greater<>> heap;
  for (int i = 0; i < n; ++i)
    if (!indeg[i]) heap.emplace(rank[i], i);
  std::vector<int> out;
  while (!heap.empty()) {
    int p = heap.top().second;
    heap.pop();
    out.push_back(p);
    for (int q : succs[p])
      if (--indeg[q] == 0) heap.emplace(rank[q], q);
  }
  if (int(out.size()) != n) throw std::logic_error("compiled transition DAG has a cycle");
  return out;
}

// Adjacency in one flat array per direction (edge order kept within each node).
struct Csr {
  std::vector<int> off, to;
  void build(int n, const std::vector<Edge>& edges, bool data_only, bool by_dst) {
    off.assign(n + 1, 0);
    for (const Edge& e : edges)
      if (!data_only || e.data) ++off[(by_dst ? e.dst : e.src) + 1];
    for (int p = 0; p < n; ++p) off[p + 1] += off[p];
    to.resize(off[n]);
    std::vector<int> at(off.begin(), off.end() - 1);
    for (const Edge& e : edges)
      if (!data_only || e.data) to[at[by_dst ? e.dst : e.src]++] = by_dst ? e.src : e.dst;
  }
  struct Range {
    const int *b, *e;
    const int* begin() const { return b; }
    const int* end() const { return e; }
    size_t size() const { return size_t(e - b); }
  };
  Range operator[](int p) const { return {to.data() + off[p], to.data() + off[p + 1]}; }
};

// The data edges of the simulation's DAG: what every refinement keeps.
struct DataGraph {
  Csr preds, succs;
  std::vector<Edge> edges;
};

DataGraph data_graph(int n, const Dag& dag) {
  DataGraph g;
  g.preds.build(n, dag.edges, true, true);
  g.succs.build(n, dag.edges, true, false);
  for (const Edge& e : dag.edges)
    if (e.data) g.edges.push_back(e);
  return g;
}

// transition_refine.makespan_lower_bound.
double lower_bound(const Problem& pb, const Compiled& c, const DataGraph& g,
                   const std::vector<double>& dur) {
  const auto& P = c.prims;
  const int n = int(P.size());
  const std::vector<int>& order = c.sim.order;
  std::vector<double> head(n, 0.0), tail(n, 0.0);
  for (int p : order)
    for (int q : g.preds[p])
      if (head[q] + dur[q] > head[p]) head[p] = head[q] + dur[q];
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    double longest = 0.0;
    for (int q : g.succs[*it])
      if (tail[q] > longest) longest = tail[q];
    tail[*it] = dur[*it] + longest;
  }
  double bound = 0.0;
  for (int p = 0; p < n; ++p) bound = std::max(bound, head[p] + tail[p]);
  const int D = pb.num_devices;
  std::vector<char> want(D, 0);
  bool any = false;
  for (const Prim& pr : P)
    for (auto [d, a] : pr.acq) want[d] = any = true;
  if (!any) return bound;
  std::vector<double> free(D, 0.0);
  for (int d = 0; d < D; ++d)
    if (want[d] && pb.exist[d]) free[d] = pb.cap[d];
  std::unordered_set<int> held;
  for (int u = 0; u < pb.num_current; ++u) {
    const Unit& x = pb.units[u];
    for (int d : x.dev)
      if (want[d] && pb.exist[d]) {
        free[d] -= x.mem;
        if (pb.stage_slots) held.insert(pb.slot_key(x.stage, d));
      }
  }
  // Resources: device d as d, slot s as D + s.
  std::vector<std::pair<int, std::vector<int64_t>>> blocked;
  std::unordered_set<int64_t> wanted;
  bool want_slots = false;
  for (int p = 0; p < n; ++p) {
    const auto& acq = P[p].acq;
    if (acq.empty()) continue;
    std::vector<int64_t> shortr;
    if (acq.size() == 1) {
      if (acq[0].second > free[acq[0].first] + kTol) shortr.push_back(acq[0].first);
    } else {
      std::vector<std::pair<int, double>> need;
      for (auto [d, a] : acq) {
        auto it = std::find_if(need.begin(), need.end(), [d = d](auto& x) { return x.first == d; });
        if (it == need.end()) {
          need.emplace_back(d, 0.0 + a);
        } else {
          it->second += a;
        }
      }
      for (auto [d, a] : need)
        if (a > free[d] + kTol) shortr.push_back(d);
    }
    if (!held.empty())
      for (int s : P[p].slot_acq)
        if (held.count(s)) {
          shortr.push_back(int64_t(D) + s);
          want_slots = true;
        }
    if (!shortr.empty()) {
      wanted.insert(shortr.begin(), shortr.end());
      blocked.emplace_back(p, std::move(shortr));
    }
  }
  if (blocked.empty()) return bound;
  std::unordered_map<int64_t, std::vector<std::pair<double, int>>> first;
  for (int q = 0; q < n; ++q) {
    if (P[q].rel.empty() && !want_slots) continue;
    std::unordered_set<int64_t> rel;
    for (auto [d, r] : P[q].rel)
      if (wanted.count(d)) rel.insert(d);
    if (want_slots)
      for (int s : P[q].slot_rel)
        if (wanted.count(int64_t(D) + s)) rel.insert(int64_t(D) + s);
    double end = head[q] + dur[q];
    for (int64_t r : rel) {
      auto& lst = first[r];
      lst.emplace_back(end, q);
      if (lst.size() > 2) {
        std::sort(lst.begin(), lst.end());
        lst.resize(2);
      }
    }
  }
  for (auto& [p, shortr] : blocked) {
    double start = head[p];
    for (int64_t r : shortr) {
      auto it = first.find(r);
      if (it == first.end()) continue;
      bool found = false;
      double lo = 0.0;
      for (auto [end, q] : it->second)
        if (q != p && (!found || end < lo)) lo = end, found = true;
      if (found && lo > start) start = lo;
    }
    if (start + tail[p] > bound) bound = start + tail[p];
  }
  return bound;
}

// transition_refine.fund_acquisition.
template <typename AddEdge>
void fund(int p, uint64_t* a_bits, Bits& anc, double need, std::vector<std::pair<int, double>>& e,
          int d, std::vector<Funding>* funding, AddEdge add_edge) {
  if (need <= kTol) return;
  std::vector<int> groups[3];
  for (int i = 0; i < int(e.size()); ++i)
    if (e[i].second > kTol) {
      int f = e[i].first;
      groups[f == -1 ? 0 : Bits::has(a_bits, f) ? 1 : 2].push_back(i);
    }
  for (auto& g : groups)
    for (int i : g) {
      int f = e[i].first;
      double rem = e[i].second, take = std::min(rem, need);
      e[i].second = rem - take;
      need -= take;
      funding->push_back(Funding{p, d, false, f, take});
      if (f != -1 && !Bits::has(a_bits, f)) {
        add_edge(f, p, kRbaDevice, d);
        anc.add(a_bits, f);
      }
      if (need <= kTol) {
        e.erase(std::remove_if(e.begin(), e.end(), [](auto& x) { return !(x.second > kTol); }),
                e.end());
        return;
      }
    }
  throw std::logic_error("device unfunded though it had room");
}

// transition_refine.refine_by_list_schedule; false when greedy gets stuck.
bool list_schedule(const Problem& pb, const Compiled& c, const DataGraph& g,
                   const std::vector<double>& dur, bool by_order, const std::vector<double>* boost,
                   bool reserve, Dag* out) {
  const auto& P = c.prims;
  const int n = int(P.size()), D = pb.num_devices;
  std::vector<int> rank(n);
  for (int i = 0; i < n; ++i) rank[c.sim.order[i]] = i;
  std::vector<double> bottom(n, 0.0);
  for (auto it = c.sim.order.rbegin(); it != c.sim.order.rend(); ++it) {
    bool some = false;
    double m = 0.0;
    for (int q : g.succs[*it])
      if (!some || bottom[q] > m) m = bottom[q], some = true;
    bottom[*it] = dur[*it] + m;
  }
  std::vector<double> used(D, 0.0);
  std::vector<char> slots(size_t(pb.num_stages) * D, 0);
  for (int u = 0; u < pb.num_current; ++u)
    for (int d : pb.units[u].dev)
      if (pb.exist[d]) {
        used[d] += pb.units[u].mem;
        slots[pb.slot_key(pb.units[u].stage, d)] = 1;
      }
  const std::vector<double> used0 = used;
  // Per device, [funder, bytes left]: memory free before (-1), then releases; made on
  // first use (few devices see an acquisition or a release).
  std::vector<std::vector<std::pair<int, double>>> funds(D);
  std::vector<char> funded(D, 0);
  auto funds_of = [&](int d) -> std::vector<std::pair<int, double>>& {
    if (!funded[d]) {
      funded[d] = 1;
      funds[d].emplace_back(-1, pb.cap[d] - used0[d]);
    }
    return funds[d];
  };
  std::vector<int> slot_free_by(size_t(pb.num_stages) * D, -1);
  std::vector<int> npred(n);
  for (int p = 0; p < n; ++p) npred[p] = int(g.preds[p].size());  // data edges are unique
  if (by_order) std::fill(bottom.begin(), bottom.end(), 0.0);
  if (boost)
    for (int p = 0; p < n; ++p) bottom[p] = bottom[p] + (*boost)[p];
  if (reserve) {
    double top = 0.0;
    for (int p = 0; p < n; ++p) top = p == 0 ? bottom[p] : std::max(top, bottom[p]);
    top += 1.0;
    for (int p = 0; p < n; ++p)
      bottom[p] = P[p].acq.empty() ? 2 * top : !P[p].rel.empty() ? top + bottom[p] : bottom[p];
  }
  auto later = [&](int a, int b) {  // heap order of (-bottom, rank)
    if (bottom[a] != bottom[b]) return bottom[a] < bottom[b];
    return rank[a] > rank[b];
  };
  std::priority_queue<int, std::vector<int>, decltype(later)> ready(later);
  for (int p = 0; p < n; ++p)
    if (!npred[p]) ready.push(p);
  using Run = std::pair<double, int>;
  std::priority_queue<Run, std::vector<Run>, std::greater<>> running;
  Bits anc(n);
  out->edges = g.edges;
  out->order.clear();
  out->funding.clear();
  std::unordered_set<int64_t> have;
  for (const Edge& e : g.edges) have.insert(int64_t(e.src) * n + e.dst);
  auto add_edge = [&](int f, int p, Why why, int arg) {
    if (have.insert(int64_t(f) * n + p).second)
      out->edges.push_back(Edge{f, p, false, why, arg, -1});
  };
  double now = 0.0;
  int finished = 0;
  std::vector<int> waiting, batch;
  std::vector<double> reserved(D, 0.0);
  std::vector<int> reserved_at;
  while (finished < n) {
    bool use_reserve = reserve;
    while (true) {
      waiting.clear();
      for (int d : reserved_at) reserved[d] = 0.0;
      reserved_at.clear();
      while (!ready.empty()) {
        int p = ready.top();
        ready.pop();
        const Prim& pr = P[p];
        bool fits = true;
        for (auto [d, a] : pr.acq) fits = fits && used[d] + a <= pb.cap[d] + kTol;
        for (int s : pr.slot_acq) fits = fits && !slots[s];
        if (fits && !reserved_at.empty() && !pr.acq.empty())
          for (auto [d, a] : pr.acq) fits = fits && used[d] + a + reserved[d] <= pb.cap[d] + kTol;
        if (!fits) {
          if (use_reserve)
            for (auto [d, a] : pr.acq) {
              if (std::find(reserved_at.begin(), reserved_at.end(), d) == reserved_at.end())
                reserved_at.push_back(d);
              reserved[d] = reserved[d] + a;
            }
          waiting.push_back(p);
          continue;
        }
        uint64_t* a_bits = anc.row(p);
        for (int q : g.preds[p]) anc.add(a_bits, q);
        for (auto [d, a] : pr.acq) {
          fund(p, a_bits, anc, a, funds_of(d), d, &out->funding, add_edge);
          used[d] += a;
        }
        for (int s : pr.slot_acq) {
          int f = slot_free_by[s];
          slot_free_by[s] = -1;
          out->funding.push_back(Funding{p, s, true, f, 1.0});
          if (f != -1 && !Bits::has(a_bits, f)) {
            add_edge(f, p, kRbaSlot, s);
            anc.add(a_bits, f);
          }
          slots[s] = 1;
        }
        out->order.push_back(p);
        running.emplace(now + dur[p], p);
      }
      for (int p : waiting) ready.push(p);
      if (!running.empty() || !use_reserve) break;
      use_reserve = false;  // reservations alone held everything back: plain greedy
    }
    if (running.empty()) return false;
    now = running.top().first;
    batch.clear();
    while (!running.empty() && running.top().first <= now) {
      batch.push_back(running.top().second);
      running.pop();
    }
    for (int p : batch) {
      for (auto [d, r] : P[p].rel) {
        used[d] -= r;
        funds_of(d).emplace_back(p, r);
      }
      for (int s : P[p].slot_rel) {
        slots[s] = 0;
        slot_free_by[s] = p;
      }
      ++finished;
      for (int q : g.succs[p])
        if (--npred[q] == 0) ready.push(q);
    }
  }
  return true;
}

// Edges on the critical path that are resource edges (their heads), or -1 entries none.
std::vector<int> resource_waits(int n, const Dag& dag, const std::vector<int>& path) {
  std::unordered_map<int64_t, bool> data;
  for (const Edge& e : dag.edges) data.emplace(int64_t(e.src) * n + e.dst, e.data);
  std::vector<int> out;
  for (size_t i = 1; i < path.size(); ++i) {
    auto it = data.find(int64_t(path[i - 1]) * n + path[i]);
    if (it != data.end() && !it->second) out.push_back(path[i]);
  }
  return out;
}

}  // namespace

double longest_path(const Compiled& c, const Dag& dag, const std::vector<double>& dur,
                    std::vector<int>* path) {
  const int n = int(c.prims.size());
  if (path) path->clear();
  if (!n) return 0.0;
  Csr preds;
  preds.build(n, dag.edges, false, true);
  std::vector<double> finish(n, 0.0);
  std::vector<int> via(n, -1);
  int end = -1;
  double end_t = -1.0;
  for (int p : topo_order(n, dag)) {
    double best = 0.0;
    int arg = -1;
    for (int q : preds[p])
      if (finish[q] > best) best = finish[q], arg = q;
    double t = finish[p] = best + dur[p];
    via[p] = arg;
    if (t > end_t) end = p, end_t = t;
  }
  if (path) {
    for (int p = end; p >= 0; p = via[p]) path->push_back(p);
    std::reverse(path->begin(), path->end());
  }
  return end_t;
}

int refine(const Problem& pb, const Compiled& c, const std::vector<double>& dur,
           std::vector<Dag>* alts) {
  const int n = int(c.prims.size());
  std::vector<int> path;
  int best = -1;
  double best_t = longest_path(c, c.sim, dur, &path);
  auto dag_of = [&](int i) -> const Dag& { return i < 0 ? c.sim : (*alts)[i]; };
  bool all_data = true;
  {
    std::unordered_map<int64_t, bool> data;
    for (const Edge& e : c.sim.edges) data.emplace(int64_t(e.src) * n + e.dst, e.data);
    for (size_t i = 1; i < path.size(); ++i) {
      auto it = data.find(int64_t(path[i - 1]) * n + path[i]);
      all_data = all_data && it != data.end() && it->second;
    }
  }
  if (all_data) return -1;  // the critical path is data edges only: nothing can be shorter
  const DataGraph g = data_graph(n, c.sim);
  double bound = lower_bound(pb, c, g, dur);
  if (best_t <= bound + 1e-9) return -1;
  auto try_alt = [&](bool by_order, const std::vector<double>* boost, bool reserve) {
    Dag alt;
    if (!list_schedule(pb, c, g, dur, by_order, boost, reserve, &alt)) return false;
    double t = longest_path(c, alt, dur, nullptr);
    if (!(t < best_t - 1e-12)) return false;
    alts->push_back(std::move(alt));
    best = int(alts->size()) - 1;
    best_t = t;
    return true;
  };
  const bool variants[3][2] = {{false, false}, {true, false}, {false, true}};
  for (auto [by_order, reserve] : variants)
    if (try_alt(by_order, nullptr, reserve) && best_t <= bound + 1e-9) return best;
  std::vector<double> boost(n, 0.0);
  for (int round = 0; round < 3; ++round) {
    longest_path(c, dag_of(best), dur, &path);
    std::vector<int> waits = resource_waits(n, dag_of(best), path);
    if (waits.empty()) break;
    for (int p : waits) boost[p] += best_t;
    bool improved = false;
    for (bool reserve : {false, true}) improved = try_alt(false, &boost, reserve) || improved;
    if (!improved || best_t <= bound + 1e-9) break;
  }
  return best;
}

std::vector<double> table_costs(const Compiled& c, double extend_setup, double extend_bw,
                                double reshard_setup, double reshard_bw, double destroy_s) {
  std::vector<double> out;
  out.reserve(c.prims.size());
  for (const Prim& pr : c.prims) {
    double moved = 0.0;
    for (auto [d, b] : pr.acq) moved += b;
    if (pr.kind == kExtend) {
      out.push_back(extend_setup + moved / extend_bw);
    } else if (pr.kind == kSplit || pr.kind == kMerge) {
      out.push_back(reshard_setup + moved / reshard_bw);
    } else {
      out.push_back(destroy_s);
    }
  }
  return out;
}

}  // namespace nereus_rl::transition
