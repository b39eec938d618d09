// The plan diff, compiled (nereus_rl/transition_diff.py): fills a Problem's unit lists.
#pragma once

#include <functional>
#include <vector>

#include "transition/dag.h"

namespace nereus_rl::transition {

/// One stage of the target plan: its units' devices are dense device indices.
struct TargetStage {
  int stage, model;
  bool trains;
  int tp, pp;
  std::vector<std::vector<int>> units;
};

/// Where a unit the diff created comes from: target stage `a`'s unit `b`, named
/// "<stage>#<c>", or half A/B of current unit `a` (uid + "a" / "b").
struct Origin {
  enum Kind { kTarget, kHalfA, kHalfB };
  int unit;
  Kind kind;
  int a, b, c;
};

/// The diff's result beyond the Problem's lists.
struct DiffResult {
  int status = kOk;
  std::vector<int> kept;
  std::vector<Origin> origin;     // created units, in creation order
  std::vector<int> memory_order;  // units in the order Python asks unit_memory
};

/// Maps pb's current units onto target (transition_diff.diff_plans). taken(stage, k)
/// tells whether a current unit is named "<stage>#<k>".
DiffResult diff_plans(Problem& pb, const std::vector<TargetStage>& target,
                      const std::vector<int64_t>& dev_id,
                      const std::function<bool(int, int)>& taken);

}  // namespace nereus_rl::transition
