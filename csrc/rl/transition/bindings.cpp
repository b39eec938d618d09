// Bindings of the compiled transition (filled in by its own change).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace nereus_rl {
void register_transition(py::module_& m) { (void)m; }
}  // namespace nereus_rl
