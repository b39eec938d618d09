// Stage Pareto lists and colocation-group tables: ports of Planner._pareto_lists and
// planner_groups.group_vectors (see planner.h for why every order is kept as is).
#include <algorithm>
#include <limits>

#include "planner/planner.h"

// Sums must be rounded one by one, in the reference's order.
#pragma GCC optimize("fp-contract=off")

namespace nereus_rl::planner {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
}

Layouts::Layouts(std::vector<int64_t> mem_, std::vector<int64_t> d_)
    : mem(std::move(mem_)), d(std::move(d_)) {
  const int32_t n = int32_t(mem.size());
  int L = 1;
  for (int64_t v : d) L = std::max(L, __builtin_ctzll(uint64_t(v)) + 1);
  at.assign(L + 1, 0);
  for (int64_t v : d) ++at[__builtin_ctzll(uint64_t(v)) + 1];
  for (int j = 0; j < L; ++j) at[j + 1] += at[j];
  order.resize(n);
  std::vector<int32_t> put(at.begin(), at.end() - 1);
  for (int32_t i = 0; i < n; ++i) order[put[__builtin_ctzll(uint64_t(d[i]))]++] = i;
  for (int j = 0; j < L; ++j) {
    std::stable_sort(order.begin() + at[j], order.begin() + at[j + 1],
                     [&](int32_t a, int32_t b) { return mem[a] < mem[b]; });
  }
}

Fronts build_fronts(const double* t, const Layouts& lay, int64_t cap, int64_t max_n) {
  // Python builds F(n) as the Pareto filter of F(n/2) plus the layouts with d == n: sorted
  // by (t, mem, layout_idx, d), an entry is kept iff its memory is below every earlier
  // entry's. That is: among the entries of equal memory only the least (t, layout_idx)
  // can be kept, and it is kept iff its t is below the t of every entry with less
  // memory. So no sort by time is needed (the times change with every refinement): the
  // candidates in memory order (F(n/2)'s kept entries merged with the size's layouts,
  // whose memory order is fixed per table) are swept once, and the kept entries, whose
  // times fall as memory grows, reversed give F(n) in the reference's order.
  int L = 0;
  while ((int64_t(1) << L) <= max_n) ++L;
  const int64_t* mem = lay.mem.data();
  Fronts f;
  f.by_j.resize(L);
  f.fast.resize(L);
  std::vector<int32_t> kept, next;  // F(n)'s layouts in memory order
  kept.reserve(lay.mem.size());
  next.reserve(lay.mem.size());
  const int num_j = int(lay.at.size()) - 1;
  for (int j = 0; j < L; ++j) {
    const int32_t* add = j < num_j ? lay.order.data() + lay.at[j] : nullptr;
    const int32_t na = j < num_j ? lay.at[j + 1] - lay.at[j] : 0;
    next.clear();
    size_t a = 0;
    int32_t b = 0;
    double run = kInf;  // least t of the entries with less memory than the current one
    while (a < kept.size() || b < na) {
      // The next memory value's entries (kept's and the size's are each in memory order;
      // within one memory value their order does not matter: the least (t, index) wins).
      const int64_t m = (b == na || (a < kept.size() && mem[kept[a]] <= mem[add[b]])) ? mem[kept[a]]
                                                                                      : mem[add[b]];
      if (m > cap) break;  // memory only grows from here
      int32_t best = -1;
      auto consider = [&](int32_t i) {
        if (best < 0 || t[i] < t[best] || (t[i] == t[best] && i < best)) best = i;
      };
      while (a < kept.size() && mem[kept[a]] == m) consider(kept[a++]);
      while (b < na && mem[add[b]] == m) consider(add[b++]);
      if (t[best] < run) {
        next.push_back(best);
        run = t[best];
      }
    }
    kept.swap(next);
    List& front = f.by_j[j];
    front.reserve(kept.size());
    for (size_t q = kept.size(); q-- > 0;) {
      const int32_t i = kept[q];
      front.push_back({t[i], mem[i], i, int32_t(lay.d[i])});
    }
    f.fast[j] = front.empty() ? kInf : front[0].t;
  }
  return f;
}

namespace {

// A partial choice within one phase: time, memory, whether some stage is wider than the
// width rule's threshold, and the (position in group, layout index) of each stage.
struct Partial {
  double t;
  int64_t mem;
  bool flag;
  std::vector<std::pair<int, int32_t>> ch;
};

struct Combo {
  double v[3];
  std::vector<std::pair<int, int32_t>> ch;
};

// _pareto2: the (time, memory) Pareto lists of cands (pool indices): all, and flagged.
void pareto2(const std::vector<Partial>& pool, std::vector<int>& cands, std::vector<int>* all,
             std::vector<int>* flagged) {
  std::stable_sort(cands.begin(), cands.end(), [&](int a, int b) {
    const Partial &x = pool[a], &y = pool[b];
    if (x.t != y.t) return x.t < y.t;
    return x.mem < y.mem;
  });
  all->clear();
  flagged->clear();
  bool have_all = false, have_flag = false;
  int64_t best_all = 0, best_flag = 0;
  for (int c : cands) {
    const Partial& p = pool[c];
    if (!have_all || p.mem < best_all) {
      all->push_back(c);
      best_all = p.mem;
      have_all = true;
    }
    if (p.flag && (!have_flag || p.mem < best_flag)) {
      flagged->push_back(c);
      best_flag = p.mem;
      have_flag = true;
    }
  }
}

// _combine3: one choice per phase list whose memory sum fits; for each (phase 0, phase 1)
// pair only the fastest phase-2 choice that fits (lists: memory strictly falling).
void combine3(const std::vector<Partial>& pool, const std::vector<int>& L0,
              const std::vector<int>& L1, const std::vector<int>& L2, int64_t cap,
              std::vector<Combo>* out) {
  for (int a : L0) {
    for (int b : L1) {
      const Partial &pa = pool[a], &pb = pool[b];
      int64_t budget = cap - pa.mem - pb.mem;
      if (budget < 0) continue;
      auto it =
          std::partition_point(L2.begin(), L2.end(), [&](int c) { return pool[c].mem > budget; });
      if (it == L2.end()) continue;
      const Partial& pc = pool[*it];
      Combo cb{{pa.t, pb.t, pc.t}, pa.ch};
      cb.ch.insert(cb.ch.end(), pb.ch.begin(), pb.ch.end());
      cb.ch.insert(cb.ch.end(), pc.ch.begin(), pc.ch.end());
      out->push_back(std::move(cb));
    }
  }
}

}  // namespace

std::vector<GroupVec> group_vectors(const std::vector<const List*>& lists,
                                    const std::vector<int>& phases, int64_t thr, int64_t cap) {
  std::vector<GroupVec> out;
  for (const List* l : lists) {
    if (l->empty()) return out;
  }
  // Fast path: every stage's fastest layout fits together.
  int64_t msum = 0;
  bool wide = thr == 0;
  for (const List* l : lists) {
    msum += (*l)[0].mem;
    wide = wide || (*l)[0].d > thr;
  }
  if (msum <= cap && wide) {
    GroupVec g{{0.0, 0.0, 0.0}, {}};
    for (size_t s = 0; s < lists.size(); ++s) {
      g.v[phases[s]] += (*lists[s])[0].t;
      g.choices.push_back((*lists[s])[0].li);
    }
    out.push_back(std::move(g));
    return out;
  }
  std::vector<Partial> pool;
  std::vector<int> all[3], flagged[3];
  bool present[3] = {false, false, false};
  std::vector<int> order;  // phases in order of first appearance (Python dict order)
  std::vector<int> cur, cands;
  for (size_t pos = 0; pos < lists.size(); ++pos) {
    int p = phases[pos];
    cur.clear();
    if (!present[p]) {
      pool.push_back({0.0, 0, thr == 0, {}});
      cur.push_back(int(pool.size()) - 1);
    } else {
      cur = all[p];
      if (thr != 0) {
        for (int c : flagged[p]) {
          if (std::find(all[p].begin(), all[p].end(), c) == all[p].end()) cur.push_back(c);
        }
      }
    }
    cands.clear();
    for (int a : cur) {
      for (const Cand& c : *lists[pos]) {
        const Partial& pa = pool[a];
        if (pa.mem + c.mem > cap) continue;
        Partial q{pa.t + c.t, pa.mem + c.mem, pa.flag || c.d > thr, pa.ch};
        q.ch.emplace_back(int(pos), c.li);
        pool.push_back(std::move(q));
        cands.push_back(int(pool.size()) - 1);
      }
    }
    pareto2(pool, cands, &all[p], &flagged[p]);
    if (!present[p]) order.push_back(p);
    present[p] = true;
  }
  pool.push_back({0.0, 0, false, {}});
  const int empty = int(pool.size()) - 1;
  const std::vector<int> empty_all{empty}, empty_flag;
  auto L = [&](int p, bool flag) -> const std::vector<int>& {
    if (!present[p]) return flag ? empty_flag : empty_all;
    return flag ? flagged[p] : all[p];
  };
  std::vector<Combo> combos;
  if (thr == 0) {
    combine3(pool, L(0, false), L(1, false), L(2, false), cap, &combos);
  } else {
    for (int star : order) {
      combine3(pool, L(0, star == 0), L(1, star == 1), L(2, star == 2), cap, &combos);
    }
  }
  // _prune3: by (sum, vector), stable; drop vectors dominated in all three phases.
  std::vector<double> sums(combos.size());
  std::vector<int> idx(combos.size());
  for (size_t i = 0; i < combos.size(); ++i) {
    sums[i] = combos[i].v[0] + combos[i].v[1] + combos[i].v[2];
    idx[i] = int(i);
  }
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) {
    if (sums[a] != sums[b]) return sums[a] < sums[b];
    const double *x = combos[a].v, *y = combos[b].v;
    for (int q = 0; q < 3; ++q) {
      if (x[q] != y[q]) return x[q] < y[q];
    }
    return false;
  });
  for (int i : idx) {
    const double* v = combos[i].v;
    bool dominated = false;
    for (const GroupVec& o : out) {
      if (o.v[0] <= v[0] && o.v[1] <= v[1] && o.v[2] <= v[2]) {
        dominated = true;
        break;
      }
    }
    if (dominated) continue;
    auto ch = combos[i].ch;
    std::sort(ch.begin(), ch.end());
    GroupVec g{{v[0], v[1], v[2]}, {}};
    for (auto& pc : ch) g.choices.push_back(pc.second);
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace nereus_rl::planner
