// The transition DAG compiler's data, compiled: units, primitives, edges and funding as
// flat records, the sequential simulation and the list-schedule refinement. Mirrors
// nereus_rl/transition_simulate.py, transition_holders.py and transition_refine.py
// step for step (same iteration orders, same float operations), so the DAGs are
// identical; tests/test_transition_golden.py checks both paths.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <utility>
#include <vector>

namespace nereus_rl::transition {

constexpr double kTol = 1e-3;  // bytes: slack for float sums of memory

enum Kind : int8_t { kExtend = 0, kDestroy = 1, kSplit = 2, kMerge = 3 };

// Why an edge exists; Python turns (why, arg, arg2) into the reason string.
enum Why : int8_t {
  kCreatedBeforeCopy = 0,   // arg: unit
  kLivesUntilCopied = 1,    // arg: unit
  kCreatedBeforeMerge = 2,  // arg: unit
  kHolds = 3,               // arg: unit, arg2: state
  kRbaDevice = 4,           // arg: device (dense)
  kRbaSlot = 5,             // arg: slot key
};

// Result codes the Python front turns into the Python compiler's exceptions.
enum Status : int {
  kOk = 0,
  kCurrentOverCapacity = 1,
  kTargetOverCapacity = 2,
  kBlocked = 3,
  kStateLoss = 4,
};

/// A vector with N elements inline (no allocation up to N): units have few devices and
/// primitives few units, and a compile makes thousands of each. T is trivially copyable.
template <typename T, size_t N>
class SmallVec {
 public:
  SmallVec() = default;
  SmallVec(std::initializer_list<T> xs) { assign(xs.begin(), xs.end()); }
  SmallVec(const SmallVec& o) { assign(o.begin(), o.end()); }
  SmallVec& operator=(const SmallVec& o) {
    if (this != &o) assign(o.begin(), o.end());
    return *this;
  }
  template <typename It>
  void assign(It b, It e) {
    resize(size_t(std::distance(b, e)));
    std::copy(b, e, data());
  }
  void resize(size_t n) {
    if (n > N) {
      if (n_ <= N) heap_.assign(buf_, buf_ + n_);
      heap_.resize(n);
    }
    n_ = n;
  }
  void push_back(const T& x) {
    resize(n_ + 1);
    data()[n_ - 1] = x;
  }
  template <typename... A>
  void emplace_back(A&&... a) {
    push_back(T{std::forward<A>(a)...});
  }
  T* data() { return n_ > N ? heap_.data() : buf_; }
  const T* data() const { return n_ > N ? heap_.data() : buf_; }
  T* begin() { return data(); }
  T* end() { return data() + n_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + n_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }

 private:
  T buf_[N];
  size_t n_ = 0;
  std::vector<T> heap_;
};

using Devs = SmallVec<int, 8>;

/// One unit: devices are dense indices; states are model ids (weights) and
/// num_models + stage (optimizer).
struct Unit {
  int stage = 0;
  int model = 0;
  bool trains = false;
  int tp = 1, pp = 1;
  Devs dev;
  double mem = 0.0;
  int num_states = 1;
  std::array<int, 2> state{{0, 0}};
};

/// One primitive: acquire/release are (dense device, bytes); slots are stage * D + device.
struct Prim {
  Kind kind = kExtend;
  int stage = 0;
  SmallVec<int, 2> ins, outs;
  int source = -1;
  bool lost = false;
  SmallVec<std::pair<int, double>, 8> acq, rel;
  Devs slot_acq, slot_rel;
};

/// One edge src -> dst; data or resource, with its reason in codes.
struct Edge {
  int src, dst;
  bool data;
  Why why;
  int arg, arg2;
};

/// One funding entry: resource is a dense device, or a slot key when slot is true.
struct Funding {
  int pid;
  int res;
  bool slot;
  int funder;
  double amount;
};

/// A DAG over the problem's primitives: what the refinement re-derives.
struct Dag {
  std::vector<Edge> edges;
  std::vector<int> order;
  std::vector<Funding> funding;
};

/// The inputs of one compile, marshalled once from the Placement and the plan diff.
struct Problem {
  int num_devices = 0;  // dense devices
  std::vector<char> exist, lostdev, touched;
  std::vector<double> cap;  // per dense device (meaningful where exist)
  int num_stages = 0;       // stage ids are their rank (target order, then current-only)
  int num_models = 0;
  std::vector<Unit> units;  // current units first (placement order), then created ones
  int num_current = 0;
  std::vector<int> lost_units, extends, destroys, target_units;
  std::vector<std::array<int, 3>> splits;  // (unit, half a, half b)
  std::vector<std::array<int, 3>> merges;  // (half a, half b, target)
  std::vector<std::array<int, 4>> relayouts;
  std::vector<int> exist_order;  // exist devices in the Python frozenset's order
  bool stage_slots = true;

  int slot_key(int stage, int dev) const { return stage * num_devices + dev; }
};

/// The compiled DAG: primitives, the simulation's DAG, anchors and early destroys.
struct Compiled {
  int status = kOk;
  std::vector<Prim> prims;
  Dag sim;
  std::vector<std::array<int, 3>> anchors;  // (pid, state, holder unit)
  std::vector<std::pair<int, int>> early;
};

/// Runs the sequential simulation (transition_simulate.Simulation.run).
Compiled simulate(const Problem& pb);

/// Length of the longest path through (prims, dag) by dur, and the path.
double longest_path(const Compiled& c, const Dag& dag, const std::vector<double>& dur,
                    std::vector<int>* path);

/// The compiler's choice among refinements (transition_compile._refine): returns the
/// index of the chosen DAG in *alts (0: the simulation's), filled with candidates.
int refine(const Problem& pb, const Compiled& c, const std::vector<double>& dur,
           std::vector<Dag>* alts);

/// default_primitive_cost, vectorized: setup + acquired bytes / bandwidth per kind.
std::vector<double> table_costs(const Compiled& c, double extend_setup, double extend_bw,
                                double reshard_setup, double reshard_bw, double destroy_s);

}  // namespace nereus_rl::transition
