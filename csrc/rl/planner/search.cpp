// Branch and bound over group sizes and choices: a port of planner_search.Search (see
// planner.h for why every sum, comparison and heap step follows the Python code).
#include <algorithm>
#include <chrono>
#include <limits>
#include <set>

#include "planner/planner.h"

#pragma GCC optimize("fp-contract=off")

namespace nereus_rl::planner {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kShave = 1.0 - 1e-12;

inline double mx(double a, double b) { return a > b ? a : b; }

int bit_length(int64_t v) {
  int n = 0;
  while (v > 0) {
    ++n;
    v >>= 1;
  }
  return n;
}

// An entry of the k-best heap: Python's (-objective, counter, picks) tuple.
struct Entry {
  double neg;
  int64_t count;
  std::vector<std::pair<int, std::vector<int32_t>>> picks;
};
inline bool less(const Entry& a, const Entry& b) {
  if (a.neg != b.neg) return a.neg < b.neg;
  return a.count < b.count;
}

// heapq's _siftdown and _siftup, step for step: the heap's array order decides the order
// of equal objectives in the result (Python sorts it stably by objective).
void sift_down(std::vector<Entry>& h, size_t start, size_t pos) {
  Entry item = std::move(h[pos]);
  while (pos > start) {
    size_t parent = (pos - 1) >> 1;
    if (less(item, h[parent])) {
      h[pos] = std::move(h[parent]);
      pos = parent;
      continue;
    }
    break;
  }
  h[pos] = std::move(item);
}

void sift_up(std::vector<Entry>& h, size_t pos) {
  size_t end = h.size(), start = pos, child = 2 * pos + 1;
  Entry item = std::move(h[pos]);
  while (child < end) {
    size_t right = child + 1;
    if (right < end && !less(h[child], h[right])) child = right;
    h[pos] = std::move(h[child]);
    pos = child;
    child = 2 * pos + 1;
  }
  h[pos] = std::move(item);
  sift_down(h, start, pos);
}

class Search {
 public:
  Search(Context& ctx, int S, int k) : ctx_(ctx), S_(S), k_(size_t(k)) {}

  void run(const std::vector<int>& masks, int64_t N) {
    memo_.assign(masks.size() * 64, {kInf, kInf, kInf, 0.0});
    rec(masks, 0, N, 0.0, 0.0, 0.0);
  }

  double thr = kInf;
  int64_t nodes = 0;
  std::vector<Entry> best;

 private:
  void offer(double obj) {
    // A plan is its groups' choices: (group, layout) of every stage identifies it.
    std::vector<int64_t> key(S_, 0);
    for (auto& [mask, ch] : picks_) {
      size_t q = 0;
      for (int s = 0; s < S_; ++s) {
        if (mask >> s & 1) key[s] = (int64_t(mask) << 32) | int64_t(ch[q++]);
      }
    }
    if (seen_.count(key) || obj >= thr) return;
    seen_.insert(std::move(key));
    best.push_back({-obj, count_++, picks_});
    sift_down(best, 0, best.size() - 1);
    if (best.size() > k_) {
      Entry last = std::move(best.back());
      best.pop_back();
      if (!best.empty()) {
        best[0] = std::move(last);
        sift_up(best, 0);
      }
    }
    if (best.size() >= k_) thr = -best[0].neg;
  }

  void dfs(const LastGroup& lg, size_t pos, double t0, double t1, double t2, int64_t mem,
           bool flag) {
    ++nodes;
    const size_t G = lg.lists.size();
    std::vector<int32_t>& ch = picks_.back().second;
    if (pos == G) {
      if (flag) {
        double obj = (m_[0] > t0 ? m_[0] : t0) + (m_[1] > t1 ? m_[1] : t1);
        offer(obj + (m_[2] > t2 ? m_[2] : t2));
      }
      return;
    }
    const int p = lg.phases[pos];
    const double q0 = lg.rmin[pos + 1][0], q1 = lg.rmin[pos + 1][1], q2 = lg.rmin[pos + 1][2];
    const int64_t room = lg.cap - mem - lg.rmem[pos + 1];
    const bool later = lg.rflag[pos + 1];
    const double m0 = m_[0], m1 = m_[1], m2 = m_[2];
    for (const Cand& c : *lg.lists[pos]) {
      if (c.mem > room) continue;  // memory falls along the list: a later layout may fit
      double a0 = t0, a1 = t1, a2 = t2;
      if (p == 0) {
        a0 += c.t;
      } else if (p == 1) {
        a1 += c.t;
      } else {
        a2 += c.t;
      }
      double b0 = a0 + q0, b1 = a1 + q1, b2 = a2 + q2;
      double lb = (m0 > b0 ? m0 : b0) + (m1 > b1 ? m1 : b1) + (m2 > b2 ? m2 : b2);
      if (lb >= thr) break;  // time grows along the list
      bool f = flag || c.d > lg.thr;
      if (!(f || later)) continue;
      ch[pos] = c.li;
      dfs(lg, pos + 1, a0, a1, a2, mem + c.mem, f);
    }
  }

  void rec(const std::vector<int>& masks, size_t i, int64_t rem, double m0, double m1, double m2) {
    ++nodes;
    const size_t ng = masks.size();
    const size_t left = ng - i - 1;
    int64_t n = int64_t(1) << (bit_length(rem - int64_t(left)) - 1);
    while (n >= 1) {
      const double* c = ctx_.cheap_row(masks[i], bit_length(n) - 1);
      const double c0 = c[0], c1 = c[1], c2 = c[2];
      if (c0 == kInf || c1 == kInf || c2 == kInf) break;
      // C_G(n) only grows as n shrinks: no smaller size of this group can do better.
      if (mx(m0, c0) + mx(m1, c1) + mx(m2, c2) >= thr) break;
      if (!left) {
        const Context::LastInfo& li = ctx_.last_info(masks[i], n);
        if (li.lg) {
          m_[0] = m0, m_[1] = m1, m_[2] = m2;
          picks_.emplace_back(masks[i], std::vector<int32_t>(li.lg->lists.size(), 0));
          dfs(*li.lg, 0, 0.0, 0.0, 0.0, 0, li.lg->thr == 0);
          picks_.pop_back();
        }
        if (!li.nxt) break;
        n = li.nxt;
        continue;
      }
      const int64_t rem2 = rem - n;
      // Bound of the groups after i: each at the largest size the others leave it.
      const int64_t n2 = int64_t(1) << (bit_length(rem2 - int64_t(left) + 1) - 1);
      const int j2 = bit_length(n2) - 1;
      std::array<double, 4>& rest = memo_[i * 64 + j2];
      if (rest[3] == 0.0) {
        double r0 = 0.0, r1 = 0.0, r2 = 0.0;
        for (size_t g = i + 1; g < ng; ++g) {
          const double* row = ctx_.cheap_row(masks[g], j2);
          if (row[0] > r0) r0 = row[0];
          if (row[1] > r1) r1 = row[1];
          if (row[2] > r2) r2 = row[2];
        }
        if (r0 == kInf || r1 == kInf || r2 == kInf) r0 = kInf;
        rest = {r0, r1, r2, 1.0};
      }
      const double r0 = rest[0], r1 = rest[1], r2 = rest[2];
      if (r0 == kInf) {
        n /= 2;
        continue;
      }
      const double b0 = m0 > r0 ? m0 : r0, b1 = m1 > r1 ? m1 : r1, b2 = m2 > r2 ? m2 : r2;
      // The cheap bound of this group at n gates building its table.
      if (mx(b0, c0) + mx(b1, c1) + mx(b2, c2) >= thr) {
        n /= 2;
        continue;
      }
      const Context::GroupTable& gt = ctx_.group_table(masks[i], n);
      if (gt.stop) break;
      for (const GroupVec& gv : gt.vecs) {
        const double a0 = m0 > gv.v[0] ? m0 : gv.v[0];
        const double a1 = m1 > gv.v[1] ? m1 : gv.v[1];
        const double a2 = m2 > gv.v[2] ? m2 : gv.v[2];
        const double lb = (a0 > r0 ? a0 : r0) + (a1 > r1 ? a1 : r1) + (a2 > r2 ? a2 : r2);
        if (lb >= thr) continue;
        picks_.emplace_back(masks[i], gv.choices);
        rec(masks, i + 1, rem2, a0, a1, a2);
        picks_.pop_back();
      }
      n /= 2;
    }
  }

  Context& ctx_;
  int S_;
  size_t k_;
  int64_t count_ = 0;
  double m_[3] = {0, 0, 0};
  std::set<std::vector<int64_t>> seen_;
  std::vector<std::pair<int, std::vector<int32_t>>> picks_;
  // rest_memo of one partition: (group position, size exponent) -> bound, filled flag.
  std::vector<std::array<double, 4>> memo_;
};

}  // namespace

LastGroup::LastGroup(std::vector<const List*> lists_, std::vector<int> phases_, int64_t thr_,
                     int64_t cap_)
    : lists(std::move(lists_)), phases(std::move(phases_)), thr(thr_), cap(cap_) {
  const size_t G = lists.size();
  rmin.assign(G + 1, {0.0, 0.0, 0.0});
  rmem.assign(G + 1, 0);
  rflag.assign(G + 1, 0);
  for (size_t pos = G; pos-- > 0;) {
    const List& l = *lists[pos];
    std::array<double, 3> r = rmin[pos + 1];
    r[phases[pos]] += l[0].t;
    rmin[pos] = r;
    rmem[pos] = rmem[pos + 1] + l.back().mem;
    bool any = false;
    for (const Cand& c : l) any = any || c.d > thr;
    rflag[pos] = rflag[pos + 1] || any;
  }
  // Shave a relative 1e-12 (as the reference): a bound must never exceed what it bounds.
  for (auto& r : rmin) r = {r[0] * kShave, r[1] * kShave, r[2] * kShave};
}

SearchOut Context::search(const PartitionIndex& pb, int k) {
  using clk = std::chrono::steady_clock;
  SearchOut out;
  auto t0 = clk::now();
  // Partitions are searched in the order of their bounds (stable: ties by index) until
  // a bound reaches the incumbent, as in the reference; but a bound is only computed
  // exactly when its partition may come next. A min-heap holds (key, exact, index):
  // keys are lower bounds until refined, and at equal keys unrefined ones come first,
  // so an exact entry on top is the next partition of the reference's order.
  Lazy& lz = lazy(pb);
  using Item = Lazy::Item;
  auto after = [](const Item& a, const Item& b) {
    if (a.key != b.key) return a.key > b.key;
    if (a.exact != b.exact) return a.exact > b.exact;
    return a.o > b.o;
  };
  // The heap left by the previous call on these bounds holds every partition but those
  // it searched (re-added below): the same entries as one built from lz afresh, and the
  // order is total (ties by index), so the pops are the same.
  std::vector<Item>& heap = lz.heap;
  if (!lz.heaped) {
    heap.reserve(lz.key.size());
    for (size_t o = 0; o < lz.key.size(); ++o) {
      if (lz.key[o] < kInf) heap.push_back({lz.key[o], lz.exact[o], int32_t(o)});
    }
    std::make_heap(heap.begin(), heap.end(), after);
    lz.heaped = true;
  }
  std::vector<Item> taken;  // searched this call: back into the heap at the end
  double bounds_s = std::chrono::duration<double>(clk::now() - t0).count();
  Search search(*this, S_, k);
  const int jmax = pb.L - 1;
  while (!heap.empty() && heap.front().key < search.thr) {
    std::pop_heap(heap.begin(), heap.end(), after);
    const Item it = heap.back();
    heap.pop_back();
    const int64_t o = it.o;
    if (!it.exact) {
      auto r0 = clk::now();
      // Exact when it is at most what comes next (or the incumbent): then it can be
      // placed in the order; otherwise a larger lower bound, and the next one is looked at.
      double cutoff = heap.empty() ? kInf : heap.front().key;
      if (search.thr < cutoff) cutoff = search.thr;
      bool exact;
      const double v = refine(pb, size_t(o), cutoff, &exact);
      lz.key[o] = v;
      lz.exact[o] = exact;
      if (v < kInf) {
        heap.push_back({v, uint8_t(exact), int32_t(o)});
        std::push_heap(heap.begin(), heap.end(), after);
      }
      bounds_s += std::chrono::duration<double>(clk::now() - r0).count();
      continue;
    }
    ++out.partitions;
    taken.push_back(it);
    // Heavy groups first (Python: sorted by -sum(Cl[mask][jmax]), stable).
    std::vector<std::pair<double, int>> gm;
    for (int m : pb.masks[o]) {
      const double* r = cheap_row(m, jmax);
      gm.emplace_back(-(r[0] + r[1] + r[2]), m);
    }
    std::stable_sort(gm.begin(), gm.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<int> masks;
    for (auto& g : gm) masks.push_back(g.second);
    search.run(masks, pb.N);
  }
  for (const Item& it : taken) {
    heap.push_back(it);
    std::push_heap(heap.begin(), heap.end(), after);
  }
  out.nodes = search.nodes;
  // Python: sorted(best, key=lambda e: -e[0]), stable over the heap's array order.
  std::vector<Entry>& best = search.best;
  std::stable_sort(best.begin(), best.end(),
                   [](const Entry& a, const Entry& b) { return -a.neg < -b.neg; });
  for (Entry& e : best) out.ranked.push_back({-e.neg, std::move(e.picks)});
  out.bounds_ms = bounds_s * 1e3;
  out.search_ms =
      std::chrono::duration<double, std::milli>(clk::now() - t0).count() - out.bounds_ms;
  return out;
}

}  // namespace nereus_rl::planner
