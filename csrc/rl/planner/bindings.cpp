// Bindings of the compiled planner search: nereus_rl._native.PlanContext and
// PartitionIndex, used by nereus_rl.planner (the Python search stays as the reference).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>

#include "planner/planner.h"

namespace py = pybind11;

namespace nereus_rl {
namespace {

using planner::Context;
using planner::Fronts;
using planner::PartitionIndex;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

void check(bool ok, const std::string& what) {
  if (!ok) throw py::value_error("nereus_rl._native planner: " + what);
}

// A stage table's memory and devices per layout, with their fixed memory order per size:
// built once per table (planner::Layouts).
using StageLayouts = planner::Layouts;

StageLayouts make_layouts(const I64& mem, const I64& d) {
  check(mem.ndim() == 1 && d.ndim() == 1 && mem.size() == d.size(),
        "mem and d must be 1-D with one entry per layout");
  for (int64_t i = 0; i < d.size(); ++i) {
    check(d.data()[i] >= 1 && (d.data()[i] & (d.data()[i] - 1)) == 0,
          "layout device counts must be powers of two");
  }
  return StageLayouts(std::vector<int64_t>(mem.data(), mem.data() + mem.size()),
                      std::vector<int64_t>(d.data(), d.data() + d.size()));
}

// times: every stage's layout times one after the other (the rollout's: its intra-node
// sync variant), then the rollout's inter-node variant when r_i >= 0.
std::unique_ptr<Context> make_context(const F64& times,
                                      const std::vector<const StageLayouts*>& layouts,
                                      std::vector<int> phases, int r_i, int a_i, int64_t cap,
                                      int64_t max_n, int64_t dpn, bool one_node) {
  const size_t S = layouts.size();
  check(S >= 1 && S <= 16, "between 1 and 16 stages");
  for (const StageLayouts* l : layouts)
    check(l != nullptr, "layouts must be StageLayouts, not None");
  check(phases.size() == S, "one phase per stage");
  for (int p : phases) check(p >= 0 && p < 3, "phases must be 0, 1 or 2");
  check(r_i >= -1 && r_i < int(S) && a_i >= -1 && a_i < int(S),
        "r_i and a_i must be stage indices or -1 (absent)");
  check(cap >= 0, "cap must be >= 0");
  check(max_n >= 1 && dpn >= 1, "max_n and devices per node must be >= 1");
  size_t total = 0;
  for (const StageLayouts* l : layouts) total += l->mem.size();
  if (r_i >= 0) total += layouts[r_i]->mem.size();
  check(times.ndim() == 1 && size_t(times.size()) == total,
        "times must hold one entry per layout of every stage, plus the rollout's inter variant");
  const double* t = times.data();
  auto fronts_of = [&](const StageLayouts& l) {
    Fronts f = planner::build_fronts(t, l, cap, max_n);
    t += l.mem.size();
    return f;
  };
  std::vector<Fronts> fronts;
  for (size_t i = 0; i < S; ++i) fronts.push_back(fronts_of(*layouts[i]));
  Fronts inter;
  if (r_i >= 0) inter = fronts_of(*layouts[r_i]);
  return std::make_unique<Context>(std::move(fronts), std::move(inter), std::move(phases), r_i, a_i,
                                   cap, dpn, one_node);
}

PartitionIndex make_index(const I64& idx, const I64& starts, std::vector<std::vector<int>> masks,
                          int N) {
  check(idx.ndim() == 2 && idx.shape(0) >= 1 && idx.shape(0) <= 16,
        "idx must be (S, rows), 1 <= S <= 16");
  check(starts.ndim() == 1 && size_t(starts.size()) == masks.size(), "one start per partition");
  check(N >= 1 && N <= (1 << 30), "N must be in 1..2^30 devices");
  PartitionIndex pb;
  pb.S = int(idx.shape(0));
  pb.N = N;
  pb.L = 0;
  while ((int64_t(1) << pb.L) <= N) ++pb.L;  // N.bit_length()
  const int64_t R = idx.shape(1);
  const int64_t* ix = idx.data();
  const int64_t* st = starts.data();
  // Every read below stays inside idx: starts ascend within [0, R], each partition's
  // groups are at most S disjoint, non-empty stage masks covering all S stages.
  const int full = (1 << pb.S) - 1;
  for (size_t o = 0; o < masks.size(); ++o) {
    const int64_t end = o + 1 < masks.size() ? st[o + 1] : R;
    check(st[o] >= 0 && st[o] <= end && end <= R, "starts must ascend within [0, rows]");
    check(!masks[o].empty() && masks[o].size() <= size_t(pb.S), "each partition needs 1..S groups");
    int seen = 0;
    for (int m : masks[o]) {
      check(m > 0 && m <= full && (seen & m) == 0,
            "a partition's masks must be disjoint, non-empty subsets of the S stages");
      seen |= m;
    }
    check(seen == full, "a partition's masks must cover all S stages");
  }
  // Keep only each row's real groups: the other columns of idx point at the empty subset.
  for (size_t o = 0; o < masks.size(); ++o) {
    pb.begin.push_back(int64_t(pb.gj.size()));
    const int64_t end = o + 1 < masks.size() ? st[o + 1] : R;
    const size_t k = masks[o].size();
    for (int64_t r = st[o]; r < end; ++r) {
      int32_t from = -1;
      for (size_t c = 0; c < k; ++c) {
        const int64_t flat = ix[c * R + r];
        check(flat >= 0 && flat / pb.L == masks[o][c], "idx does not match the partitions' masks");
        pb.gj.push_back(uint8_t(flat % pb.L));
        if (from < 0 && (r == st[o] || flat != ix[c * R + r - 1])) from = int32_t(c);
      }
      check(from >= 0, "a partition's size assignments must be distinct");
      pb.from.push_back(uint8_t(from));
    }
  }
  pb.begin.push_back(int64_t(pb.gj.size()));
  pb.masks = std::move(masks);
  planner::index_prefixes(pb);
  return pb;
}

py::tuple group_of(int mask) {
  std::vector<int> g;
  for (int s = 0; mask >> s; ++s) {
    if (mask >> s & 1) g.push_back(s);
  }
  py::tuple t(g.size());
  for (size_t i = 0; i < g.size(); ++i) t[i] = g[i];
  return t;
}

py::tuple search(Context& ctx, const PartitionIndex& pb, int k) {
  check(k >= 1, "k must be >= 1");
  check(pb.S == ctx.num_stages() && pb.L <= ctx.num_sizes(),
        "the partition index must be for this context's stages and at most its devices");
  planner::SearchOut out = ctx.search(pb, k);
  py::list ranked;
  for (const auto& f : out.ranked) {
    py::list picks;
    for (const auto& [mask, ch] : f.picks) {
      py::tuple c(ch.size());
      for (size_t i = 0; i < ch.size(); ++i) c[i] = ch[i];
      picks.append(py::make_tuple(group_of(mask), c));
    }
    ranked.append(py::make_tuple(f.obj, picks));
  }
  return py::make_tuple(ranked, out.nodes, out.partitions, out.bounds_ms, out.search_ms);
}

}  // namespace

void register_planner(py::module_& m) {
  py::class_<PartitionIndex>(m, "PartitionIndex",
                             "Set partitions of S stages with their maximal power-of-two size "
                             "assignments on N devices (planner_bounds.PartitionBounds)")
      .def(py::init(&make_index), py::arg("idx"), py::arg("starts"), py::arg("masks"), py::arg("N"))
      .def_static(
          "build",
          [](int S, int64_t N) {
            // Bell(10) = 115,975 partitions: enough for any RL step's stages.
            check(S >= 1 && S <= 10, "between 1 and 10 stages");
            check(N >= 1 && N <= (int64_t(1) << 30), "N must be in 1..2^30 devices");
            return planner::build_index(S, N);
          },
          py::arg("S"), py::arg("N"),
          "The index of S stages on N devices built here (the same as from "
          "planner_bounds.PartitionBounds(S, N), without building that)")
      .def_readonly("N", &PartitionIndex::N)
      .def(
          "arrays",
          [](const PartitionIndex& pb) {
            return py::make_tuple(pb.masks, pb.gj, pb.begin, pb.from, pb.skip, pb.row0);
          },
          "(masks, gj, begin, from, skip, row0): the index's arrays, for tests");
  py::class_<StageLayouts>(m, "StageLayouts",
                           "Memory and devices of a stage table's layouts (int64 arrays)")
      .def(py::init(&make_layouts), py::arg("mem"), py::arg("d"));
  py::class_<Context>(m, "PlanContext",
                      "Compiled exact-planner search over one set of stage tables priced with "
                      "one set of efficiencies and a capacity (see csrc/rl/planner/planner.h)")
      .def(py::init(&make_context), py::arg("times"), py::arg("layouts"), py::arg("phases"),
           py::arg("r_i"), py::arg("a_i"), py::arg("cap"), py::arg("max_n"), py::arg("dpn"),
           py::arg("one_node"))
      .def("search", &search, py::arg("pidx"), py::arg("k"),
           "(ranked [(objective, [(group, choices)])] best first, nodes, partitions searched, "
           "bounds_ms, search_ms); ranked is empty when nothing fits")
      .def(
          "warm",
          [](Context& ctx, const PartitionIndex& pb) {
            check(pb.S == ctx.num_stages() && pb.L <= ctx.num_sizes(),
                  "the partition index must be for this context's stages and at most its devices");
            ctx.lazy(pb);
          },
          py::arg("pidx"),
          "Compute the lazy partition keys on pidx.N devices ahead of a search (the first "
          "search on that device count would; results are unchanged)")
      .def(
          "bounds",
          [](Context& ctx, const PartitionIndex& pb) {
            check(pb.S == ctx.num_stages() && pb.L <= ctx.num_sizes(),
                  "the partition index must be for this context's stages and at most its devices");
            const auto& b = ctx.bounds(pb);
            return py::make_tuple(b.first, b.second);
          },
          py::arg("pidx"), "(order of partitions to search, bound of every partition)")
      .def("cheap_table", [](const Context& ctx) {
        const auto& C = ctx.cheap();
        const py::ssize_t L = ctx.num_sizes(), M = py::ssize_t(C.size()) / (3 * L);
        return py::array_t<double>({M, L, py::ssize_t(3)}, C.data());
      });
}

}  // namespace nereus_rl
