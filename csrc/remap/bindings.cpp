// Bindings of the shard-remap planners: nereus_comm._C.remap_plan -> RemapPlan (dp x tp x pp
// grids) and nereus_comm._C.sharded_plan -> ShardedPieces (N-D mesh shardings).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <utility>

#include "common.h"
#include "remap/planner.h"
#include "remap/sharded.h"

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

// The sharded planner's input arrays: int64 (or safely castable to it), never a float.
using I64Exact = py::array_t<int64_t, py::array::c_style>;

std::vector<int64_t> take(const I64Exact& a, const char* what) {
  NEREUS_CHECK(a.ndim() == 1, what << " must be a 1-D array, got " << a.ndim() << " dims");
  return std::vector<int64_t>(a.data(), a.data() + a.size());
}

#define NEREUS_SHARDED_ARRAY(name)                                \
  def_property_readonly(#name, [](py::object self) {              \
    return view(self, self.cast<sharded::ShardedResult&>().name); \
  })

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
      .NEREUS_ARRAY(asg_lo)
      .NEREUS_ARRAY(asg_hi)
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

void register_sharded(py::module_& m) {
  py::class_<sharded::ShardedResult>(
      m, "ShardedPieces", "Pieces of a sharded plan (arrays are read-only views; see sharded.h)")
      .NEREUS_SHARDED_ARRAY(tensor)
      .NEREUS_SHARDED_ARRAY(src)
      .NEREUS_SHARDED_ARRAY(dst)
      .NEREUS_SHARDED_ARRAY(nbytes)
      .NEREUS_SHARDED_ARRAY(remote)
      .NEREUS_SHARDED_ARRAY(cut_length)
      .NEREUS_SHARDED_ARRAY(box_offset)
      .NEREUS_SHARDED_ARRAY(box)
      .NEREUS_SHARDED_ARRAY(src_local)
      .NEREUS_SHARDED_ARRAY(dst_local)
      .def_readonly("lower_bound_bytes", &sharded::ShardedResult::lower_bound_bytes)
      .def_readonly("remote_bytes", &sharded::ShardedResult::remote_bytes)
      .def_readonly("local_bytes", &sharded::ShardedResult::local_bytes)
      .def_readonly("num_remote", &sharded::ShardedResult::num_remote);

  m.def(
      "sharded_plan",
      [](const I64Exact& tensor_ndim, const I64Exact& tensor_shape,
         const I64Exact& tensor_elem_size, const I64Exact& tensor_src, const I64Exact& tensor_dst,
         const I64Exact& mesh_ndim, const I64Exact& mesh_shape, const I64Exact& kind,
         const I64Exact& dim, const I64Exact& split_factor, const I64Exact& ranks,
         const I64Exact& nodes, const I64Exact& order_offset, const I64Exact& order) {
        sharded::ShardedInput in;
        in.tensor_ndim = take(tensor_ndim, "tensor_ndim");
        in.tensor_shape = take(tensor_shape, "tensor_shape");
        in.tensor_elem_size = take(tensor_elem_size, "tensor_elem_size");
        in.tensor_src = take(tensor_src, "tensor_src");
        in.tensor_dst = take(tensor_dst, "tensor_dst");
        in.mesh_ndim = take(mesh_ndim, "mesh_ndim");
        in.mesh_shape = take(mesh_shape, "mesh_shape");
        in.kind = take(kind, "kind");
        in.dim = take(dim, "dim");
        in.split_factor = take(split_factor, "split_factor");
        in.ranks = take(ranks, "ranks");
        in.nodes = take(nodes, "nodes");
        in.order_offset = take(order_offset, "order_offset");
        in.order = take(order, "order");
        py::gil_scoped_release release;
        return sharded::plan(in);
      },
      py::arg("tensor_ndim"), py::arg("tensor_shape"), py::arg("tensor_elem_size"),
      py::arg("tensor_src"), py::arg("tensor_dst"), py::arg("mesh_ndim"), py::arg("mesh_shape"),
      py::arg("kind"), py::arg("dim"), py::arg("split_factor"), py::arg("ranks"), py::arg("nodes"),
      py::arg("order_offset"), py::arg("order"),
      "Plan moving tensors between N-D mesh shardings (flat int64 arrays, see sharded.h); "
      "returns ShardedPieces. Releases the GIL while planning.");
}

}  // namespace nereus
