// Bindings of the remap part (placeholder until the part lands).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace nereus {
void register_remap(py::module_& m) { (void)m; }
}  // namespace nereus
