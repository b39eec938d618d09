// Bindings of the NCCL loader: nereus_comm._C.NcclLibrary and _C.NcclError.
// Communicators, streams and device pointers cross as integers; calls that may
// wait on other ranks release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "nccl/nccl_library.h"

namespace py = pybind11;

namespace nereus {

namespace {
std::vector<P2pOp> to_ops(const std::vector<std::tuple<int, std::uintptr_t, std::size_t>>& in) {
  std::vector<P2pOp> ops;
  ops.reserve(in.size());
  for (const auto& [peer, ptr, nbytes] : in) ops.push_back(P2pOp{peer, ptr, nbytes});
  return ops;
}
}  // namespace

void register_nccl(py::module_& m) {
  py::register_exception<NcclCallError>(m, "NcclError", PyExc_RuntimeError);

  using GIL = py::call_guard<py::gil_scoped_release>;
  py::class_<NcclLibrary>(m, "NcclLibrary", "A dlopen'ed libnccl.so.2 (see nereus_comm.nccl).")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def_property_readonly("path", &NcclLibrary::path)
      .def_property_readonly("version", &NcclLibrary::version)
      .def_property_readonly("has_shrink", &NcclLibrary::has_shrink)
      .def_property_readonly("has_grow", &NcclLibrary::has_grow)
      .def("get_unique_id", [](const NcclLibrary& lib) { return py::bytes(lib.get_unique_id()); })
      .def("comm_init_rank", &NcclLibrary::comm_init_rank, py::arg("nranks"), py::arg("unique_id"),
           py::arg("rank"), GIL())
      .def("comm_split", &NcclLibrary::comm_split, py::arg("comm"), py::arg("color"),
           py::arg("key"), GIL())
      .def("comm_shrink", &NcclLibrary::comm_shrink, py::arg("comm"), py::arg("exclude_ranks"),
           py::arg("abort_pending") = false, GIL())
      .def("comm_get_unique_id",
           [](const NcclLibrary& lib, std::uintptr_t comm) {
             return py::bytes(lib.comm_get_unique_id(comm));
           })
      .def("comm_grow", &NcclLibrary::comm_grow, py::arg("comm"), py::arg("nranks"),
           py::arg("unique_id"), py::arg("rank"), GIL())
      .def("comm_destroy", &NcclLibrary::comm_destroy, py::arg("comm"), GIL())
      .def("comm_abort", &NcclLibrary::comm_abort, py::arg("comm"), GIL())
      .def("comm_get_async_error", &NcclLibrary::comm_get_async_error, py::arg("comm"))
      .def("comm_count", &NcclLibrary::comm_count, py::arg("comm"))
      .def("comm_user_rank", &NcclLibrary::comm_user_rank, py::arg("comm"))
      .def(
          "group_send_recv",
          [](const NcclLibrary& lib, std::uintptr_t comm,
             const std::vector<std::tuple<int, std::uintptr_t, std::size_t>>& sends,
             const std::vector<std::tuple<int, std::uintptr_t, std::size_t>>& recvs,
             std::uintptr_t stream) {
            std::vector<P2pOp> s = to_ops(sends), r = to_ops(recvs);
            py::gil_scoped_release release;
            lib.group_send_recv(comm, s, r, stream);
          },
          py::arg("comm"), py::arg("sends"), py::arg("recvs"), py::arg("stream"))
      .def("error_string", &NcclLibrary::error_string, py::arg("code"));
}

}  // namespace nereus
