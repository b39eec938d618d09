// Per-(shapes, efficiencies, capacity) data of the compiled search: the cheap bounds of
// every stage subset, the partition bounds on N devices (ports of planner_bounds), and the
// group tables and last-group data, built on first use and kept across calls.
#include <algorithm>
#include <limits>
#include <numeric>

#include "planner/planner.h"

#pragma GCC optimize("fp-contract=off")

namespace nereus_rl::planner {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();
// planner_bounds._BIG: finite stand-in for "no layout fits" inside the masked sum.
constexpr double kBig = 1e300;

int log2_exact(int64_t n) {
  int j = 0;
  while ((int64_t(1) << j) < n) ++j;
  return j;
}
}  // namespace

Context::Context(std::vector<Fronts> fronts, Fronts rollout_inter, std::vector<int> phases, int r_i,
                 int a_i, int64_t cap, int64_t dpn, bool one_node)
    : fronts_(std::move(fronts)),
      rinter_(std::move(rollout_inter)),
      phases_(std::move(phases)),
      S_(int(fronts_.size())),
      r_i_(r_i),
      a_i_(a_i),
      L_(int(fronts_.at(0).fast.size())),
      cap_(cap),
      dpn_(dpn),
      one_node_(one_node) {
  // Each stage's fastest layout alone at each size (rollout: the faster sync variant).
  std::vector<std::vector<double>> smin(S_);
  for (int i = 0; i < S_; ++i) {
    smin[i] = fronts_[i].fast;
    if (i == r_i_) {
      for (int j = 0; j < L_; ++j) {
        double a = fronts_[i].fast[j], b = rinter_.fast[j];
        smin[i][j] = a < b ? a : b;
      }
    }
  }
  // cheap_table: members @ per, i.e. per phase the sum over the subset's stages in stage
  // order (a subset's sum is its lower stages' sum plus its highest stage's time, which
  // is that order); >= _BIG / 2 (some stage fits nothing) is inf. Then the planner's
  // 1e-12 shave. The raw sums are built in C_ itself (each subset's from a smaller one's,
  // so before any is shaved), then shaved in place: one array, written once (this runs
  // on every new context, i.e. after every refinement).
  const size_t M = size_t(1) << S_;
  const size_t row = size_t(L_) * 3;
  C_.resize(M * row);
  std::fill(C_.begin(), C_.begin() + row, 0.0);  // the empty subset
  for (size_t mask = 1; mask < M; ++mask) {
    int top = 0;
    while (mask >> (top + 1)) ++top;
    const size_t low = mask & ~(size_t(1) << top);
    double* at = &C_[mask * row];
    const double* from = &C_[low * row];
    std::copy(from, from + row, at);
    const double* sm = smin[top].data();
    for (int j = 0; j < L_; ++j) at[j * 3 + phases_[top]] += std::min(sm[j], kBig);
  }
  for (double& v : C_) v = (v >= kBig / 2 ? kInf : v) * (1.0 - 1e-12);
}

std::vector<const List*> Context::lists_of(int mask, int64_t n, int64_t* thr, bool* both) const {
  *both = r_i_ >= 0 && a_i_ >= 0 && (mask >> r_i_ & 1) && (mask >> a_i_ & 1);
  // The cost model's rule: intra-node sync when the cluster is one node, or rollout and
  // actor_train share a group within a node.
  const bool intra = one_node_ || (*both && n <= dpn_);
  *thr = (*both && !intra) ? dpn_ : 0;
  const int j = log2_exact(n);
  std::vector<const List*> lists;
  for (int i = 0; i < S_; ++i) {
    if (!(mask >> i & 1)) continue;
    const Fronts& f = (i == r_i_ && !intra) ? rinter_ : fronts_[i];
    lists.push_back(&f.by_j[j]);
  }
  return lists;
}

const Context::GroupTable& Context::group_table(int mask, int64_t n) {
  auto key = std::make_pair(mask, n);
  auto it = groups_.find(key);
  if (it != groups_.end()) return it->second;
  int64_t thr;
  bool both;
  auto lists = lists_of(mask, n, &thr, &both);
  std::vector<int> ph;
  for (int i = 0; i < S_; ++i) {
    if (mask >> i & 1) ph.push_back(phases_[i]);
  }
  GroupTable gt{group_vectors(lists, ph, thr, cap_), false};
  // Empty: nothing fits at n; for a group without rollout and actor_train also at no
  // smaller size.
  gt.stop = gt.vecs.empty() && !both;
  return groups_.emplace(key, std::move(gt)).first->second;
}

const Context::LastInfo& Context::last_info(int mask, int64_t n) {
  auto key = std::make_pair(mask, n);
  auto it = lasts_.find(key);
  if (it != lasts_.end()) return it->second;
  int64_t thr;
  bool both;
  auto lists = lists_of(mask, n, &thr, &both);
  LastInfo li;
  bool all = std::all_of(lists.begin(), lists.end(), [](const List* l) { return !l->empty(); });
  if (all) {
    std::vector<int> ph;
    for (int i = 0; i < S_; ++i) {
      if (mask >> i & 1) ph.push_back(phases_[i]);
    }
    li.lg = std::make_unique<LastGroup>(lists, ph, thr, cap_);
  }
  // A larger size holds every smaller size's choices, except that a group with the width
  // rule gets the intra-node sync at a node or less.
  li.nxt = (thr && n > dpn_) ? dpn_ : 0;
  return lasts_.emplace(key, std::move(li)).first->second;
}

const std::pair<std::vector<int64_t>, std::vector<double>>& Context::bounds(
    const PartitionIndex& pb) {
  auto it = bounds_.find(pb.N);
  if (it != bounds_.end()) return it->second;
  if (bounds_.size() > 16) bounds_.clear();
  // PartitionBounds.partition_bounds: per row (a partition with one maximal size
  // assignment) the per-phase maximum over its groups, summed over phases; the minimum
  // over each partition's rows. (The reference's extra columns hit the empty subset,
  // whose bounds are 0: the maxima start there.)
  const size_t P = pb.masks.size();
  std::vector<double> lbs(P, kInf);
  double pre[17][3];  // pre[c]: maxima over the row's first c columns
  pre[0][0] = pre[0][1] = pre[0][2] = 0.0;
  int64_t row = 0;
  const double* base[17];  // per column of the partition: its group's bounds at size 1
  for (size_t o = 0; o < P; ++o) {
    const int64_t k = int64_t(pb.masks[o].size());
    for (int64_t c = 0; c < k; ++c) base[c] = cheap_row(pb.masks[o][c], 0);
    double lo = kInf;
    for (int64_t e = pb.begin[o]; e < pb.begin[o + 1]; e += k, ++row) {
      // Most rows differ from the previous one in the last column only: the columns
      // before it update the stored maxima, the last one is folded in registers.
      for (int64_t c = pb.from[row]; c < k - 1; ++c) {
        const double* v = base[c] + 3 * pb.gj[e + c];
        pre[c + 1][0] = std::max(pre[c][0], v[0]);
        pre[c + 1][1] = std::max(pre[c][1], v[1]);
        pre[c + 1][2] = std::max(pre[c][2], v[2]);
      }
      const double* v = base[k - 1] + 3 * pb.gj[e + k - 1];
      const double* m = pre[k - 1];
      const double s = (std::max(m[0], v[0]) + std::max(m[1], v[1])) + std::max(m[2], v[2]);
      lo = std::min(lo, s);
    }
    lbs[o] = lo;
  }
  std::vector<int64_t> order(P);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lbs[a] < lbs[b]; });
  order.resize(std::count_if(lbs.begin(), lbs.end(), [](double v) { return v < kInf; }));
  return bounds_.emplace(pb.N, std::make_pair(std::move(order), std::move(lbs))).first->second;
}

void index_prefixes(PartitionIndex& pb) {
  const size_t P = pb.masks.size();
  pb.row0.assign(P + 1, 0);
  for (size_t o = 0; o < P; ++o) {
    const int64_t k = int64_t(pb.masks[o].size());
    pb.row0[o + 1] = pb.row0[o] + int32_t((pb.begin[o + 1] - pb.begin[o]) / k);
  }
  pb.skip.assign(pb.gj.size(), 0);
  for (size_t o = 0; o < P; ++o) {
    const int64_t k = int64_t(pb.masks[o].size());
    const int32_t end = pb.row0[o + 1];
    for (int32_t r = end - 1; r >= pb.row0[o]; --r) {
      int32_t* sk = &pb.skip[pb.begin[o] + (r - pb.row0[o]) * k];
      for (int64_t c = 0; c < k; ++c) {
        // Row r + 1 shares row r's first c + 1 columns unless it differs at one of them.
        sk[c] = r + 1 == end || pb.from[r + 1] <= c ? r + 1 : sk[k + c];
      }
    }
  }
}

Context::Lazy& Context::lazy(const PartitionIndex& pb) {
  auto it = lazy_.find(pb.N);
  if (it != lazy_.end()) return it->second;
  if (lazy_.size() > 16) lazy_.clear();
  // First key of each partition: in a maximal assignment some group g is the largest,
  // at 2^jg <= N - k + 1, and every other group is at most 2^jo (no larger than g, and
  // the others need a device each). C only grows as sizes shrink, so g at jg and the
  // others at jo bound every such row from below (the same sum as a row's, so bit for
  // bit); the key is the least over g and jg. Below the first jg with jo == jg nothing
  // is lower (both sizes only shrink).
  const size_t P = pb.masks.size();
  Lazy lz{std::vector<double>(P), std::vector<uint8_t>(P, 0), {}, false};
  // The (jg, jo) pairs visited depend only on N and the number of groups k: listed once
  // per k (this function runs on every new context and device count, and the exponent
  // loops were a large part of it).
  std::vector<std::vector<std::pair<int, int>>> steps(S_ + 1);
  for (int64_t k = 1; k <= S_ && k <= pb.N; ++k) {
    const int jt = log2_exact(pb.N - k + 2) - 1;  // floor(log2(N - k + 1))
    int top_jo = -1;
    for (int jg = jt; jg >= 0; --jg) {
      const int64_t room = pb.N - (int64_t(1) << jg) - (k - 2);  // the largest other's
      const int jo = k > 1 ? std::min(jg, log2_exact(room + 1) - 1) : jg;
      // A pair with jg and jo both no larger than an earlier pair's gives no lower key (C
      // only grows as sizes shrink, and the sums are monotone): left out, the least over
      // the pairs is the same bit for bit. jg only falls, so that is jo <= an earlier jo.
      if (jo > top_jo) steps[k].emplace_back(jg, jo);
      top_jo = std::max(top_jo, jo);
      if (jo == jg) break;
    }
  }
  const double* C = C_.data();
  const size_t row = size_t(L_) * 3;
  for (size_t o = 0; o < P; ++o) {
    const int* m = pb.masks[o].data();
    const int64_t k = int64_t(pb.masks[o].size());
    double key = kInf;
    for (const auto& [jg, jo] : steps[k]) {
      // Per phase the two largest of the groups at jo, to leave one group out; branch
      // free, in registers (this loop is most of a new context's or device count's
      // bounds).
      double t0 = 0.0, t1 = 0.0, t2 = 0.0, s0 = 0.0, s1 = 0.0, s2 = 0.0;
      for (int64_t g = 0; g < k; ++g) {
        const double* v = C + m[g] * row + jo * 3;
        s0 = std::max(s0, std::min(t0, v[0]));
        s1 = std::max(s1, std::min(t1, v[1]));
        s2 = std::max(s2, std::min(t2, v[2]));
        t0 = std::max(t0, v[0]);
        t1 = std::max(t1, v[1]);
        t2 = std::max(t2, v[2]);
      }
      if (jo == jg) {
        // Every group at the same size: each q is the maximum over all groups, top.
        key = std::min(key, (t0 + t1) + t2);
        continue;
      }
      for (int64_t g = 0; g < k; ++g) {
        // The others' maximum without g: second where g holds the top (when two groups
        // hold it, second equals it), top elsewhere.
        const double* w = C + m[g] * row + jo * 3;
        const double* v = C + m[g] * row + jg * 3;
        const double q0 = std::max(v[0], w[0] == t0 ? s0 : t0);
        const double q1 = std::max(v[1], w[1] == t1 ? s1 : t1);
        const double q2 = std::max(v[2], w[2] == t2 ? s2 : t2);
        key = std::min(key, (q0 + q1) + q2);
      }
    }
    lz.key[o] = key;
  }
  return lazy_.emplace(pb.N, std::move(lz)).first->second;
}

double Context::refine(const PartitionIndex& pb, size_t o, double cutoff, bool* exact) const {
  // Branch and bound over partition o's rows (the maximal size assignments, sorted): a
  // prefix of columns is bounded by its maxima and, for the columns after it, each
  // group at the largest size it can get (suf); a prefix whose bound cannot beat the
  // best row, or exceeds cutoff, is skipped with all the rows that share it. The best
  // row's value is computed as in bounds(), so it is that function's value bit for bit.
  const int64_t k = int64_t(pb.masks[o].size());
  const int jt = log2_exact(pb.N - k + 2) - 1;
  const double* base[17];
  double suf[17][3];
  suf[k][0] = suf[k][1] = suf[k][2] = 0.0;
  for (int64_t c = k - 1; c >= 0; --c) {
    base[c] = cheap_row(pb.masks[o][c], 0);
    const double* v = cheap_row(pb.masks[o][c], jt);
    for (int p = 0; p < 3; ++p) suf[c][p] = std::max(suf[c + 1][p], v[p]);
  }
  double pre[17][3];
  pre[0][0] = pre[0][1] = pre[0][2] = 0.0;
  double best = kInf, pruned = kInf;  // best row; least bound of a prefix over cutoff
  const int32_t end = pb.row0[o + 1];
  int32_t r = pb.row0[o];
  int64_t c = 0;
  while (r < end) {
    const int64_t e = pb.begin[o] + int64_t(r - pb.row0[o]) * k;
    bool cut = false;
    for (; c < k - 1; ++c) {
      const double* v = base[c] + 3 * pb.gj[e + c];
      double* q = pre[c + 1];
      q[0] = std::max(pre[c][0], v[0]);
      q[1] = std::max(pre[c][1], v[1]);
      q[2] = std::max(pre[c][2], v[2]);
      const double lb = (std::max(q[0], suf[c + 1][0]) + std::max(q[1], suf[c + 1][1])) +
                        std::max(q[2], suf[c + 1][2]);
      if (lb >= best || lb > cutoff) {
        if (lb < best && lb < pruned) pruned = lb;
        r = pb.skip[e + c];
        if (r < end) c = pb.from[r];
        cut = true;
        break;
      }
    }
    if (cut) continue;
    const double* v = base[k - 1] + 3 * pb.gj[e + k - 1];
    const double* m = pre[k - 1];
    const double s = (std::max(m[0], v[0]) + std::max(m[1], v[1])) + std::max(m[2], v[2]);
    if (s < best) best = s;
    ++r;
    if (r < end) c = std::min<int64_t>(pb.from[r], k - 1);
  }
  // Rows skipped for the best row are no better than it; those skipped for the cutoff are
  // at least `pruned`.
  *exact = best <= pruned;
  return *exact ? best : pruned;
}

}  // namespace nereus_rl::planner
