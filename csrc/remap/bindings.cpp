// Bindings of the shard-remap planner: nereus_comm._C.remap_plan -> RemapPlan.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <utility>

#include "common.h"
#include "remap/planner.h"

namespace py = pybind11;

namespace nereus {
namespace {

using remap::PlanResult;
using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> to_vector(const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
  NEREUS_CHECK(a.ndim() == 1, "1-D arrays only");
  return std::vector<T>(a.data(), a.data() + a.size());
}

// A zero-copy, read-only numpy view of a vector owned by the PlanResult behind `self`.
template <typename T>
py::array view(const py::object& self, const std::vector<T>& v) {
  py::array a = py::array_t<T>({static_cast<py::ssize_t>(v.size())}, {sizeof(T)}, v.data(), self);
  a.attr("setflags")(py::arg("write") = false);
  return a;
}

#define NEREUS_ARRAY(name)     \
  def_property_readonly(#name, \
                        [](py::object self) { return view(self, self.cast<PlanResult&>().name); })

}  // namespace

void register_remap(py::module_& m) {
  py::class_<PlanResult>(m, "RemapPlan",
                         "Compact shard-remap plan (arrays are read-only views; see planner.h)")
      .NEREUS_ARRAY(item_tensor)
      .NEREUS_ARRAY(item_start)
      .NEREUS_ARRAY(item_stop)
      .NEREUS_ARRAY(item_bytes)
      .NEREUS_ARRAY(block_offset)
      .NEREUS_ARRAY(asg_dst)
      .NEREUS_ARRAY(asg_src)
      .NEREUS_ARRAY(asg_begin)
      .NEREUS_ARRAY(asg_end)
      .NEREUS_ARRAY(asg_bytes)
      .NEREUS_ARRAY(send_order)
      .NEREUS_ARRAY(local_dst)
      .NEREUS_ARRAY(local_block)
      .NEREUS_ARRAY(send_bytes)
      .NEREUS_ARRAY(recv_bytes)
      .NEREUS_ARRAY(local_bytes)
      .def_readonly("total_bytes", &PlanResult::total_bytes)
      .def_readonly("lower_bound_bytes", &PlanResult::lower_bound_bytes)
      .def_readonly("local_total", &PlanResult::local_total)
      .def_readonly("max_send_bytes", &PlanResult::max_send_bytes)
      .def_readonly("max_recv_bytes", &PlanResult::max_recv_bytes)
      .def_readonly("cross_node_bytes", &PlanResult::cross_node_bytes)
      .def_readonly("num_messages", &PlanResult::num_messages);

  m.def(
      "remap_plan",
      [](std::tuple<int64_t, int64_t, int64_t> src_dims, const I32& src_node,
         std::tuple<int64_t, int64_t, int64_t> dst_dims, const I32& dst_node, const I64& dst_in_src,
         const I64& length, const I64& unit_bytes, const I32& split, const I32& src_stage,
         const I32& dst_stage) {
        remap::PlanInput in;
        std::tie(in.src.dp, in.src.tp, in.src.pp) = src_dims;
        std::tie(in.dst.dp, in.dst.tp, in.dst.pp) = dst_dims;
        in.src.node = to_vector(src_node);
        in.dst.node = to_vector(dst_node);
        in.dst_in_src = to_vector(dst_in_src);
        const auto n = length.size();
        NEREUS_CHECK(unit_bytes.size() == n && split.size() == n && src_stage.size() == n &&
                         dst_stage.size() == n,
                     "tensor arrays must have one entry per tensor");
        in.tensors.resize(n);
        for (py::ssize_t i = 0; i < n; ++i)
          in.tensors[i] = {length.at(i), unit_bytes.at(i), split.at(i) != 0, src_stage.at(i),
                           dst_stage.at(i)};
        py::gil_scoped_release release;
        return remap::plan(in);
      },
      py::arg("src_dims"), py::arg("src_node"), py::arg("dst_dims"), py::arg("dst_node"),
      py::arg("dst_in_src"), py::arg("length"), py::arg("unit_bytes"), py::arg("split"),
      py::arg("src_stage"), py::arg("dst_stage"),
      "Plan a shard remap between two dp x tp x pp grids (positions, not rank ids); "
      "returns a RemapPlan. Releases the GIL while planning.");
}

}  // namespace nereus
