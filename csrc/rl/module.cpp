// nereus_rl._native: compiled paths of the decision layer (planner search, transition
// DAG compiler). Kept out of nereus_comm._C because nereus_comm never depends on
// nereus_rl; like the comm core it has no torch or CUDA headers. Each part binds itself.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace nereus_rl {
void register_planner(py::module_& m);
void register_transition(py::module_& m);
}  // namespace nereus_rl

PYBIND11_MODULE(_native, m) {
  m.doc() = "Nereus decision layer, compiled: planner search and transition DAG compiler";
  nereus_rl::register_planner(m);
  nereus_rl::register_transition(m);
}
