// nereus_comm._C: the native core of nereus_comm. Each part binds itself.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace nereus {
void register_remap(py::module_& m);
void register_sharded(py::module_& m);
void register_copy(py::module_& m);
void register_nccl(py::module_& m);
void register_pool(py::module_& m);
}  // namespace nereus

PYBIND11_MODULE(_C, m) {
  m.doc() = "Nereus native core: shard-remap planners, host pack/unpack, NCCL loader, comm pool";
  nereus::register_remap(m);
  nereus::register_sharded(m);
  nereus::register_copy(m);
  nereus::register_nccl(m);
  nereus::register_pool(m);
}
