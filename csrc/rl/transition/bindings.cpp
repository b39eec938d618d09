// Bindings of the compiled transition DAG compiler, and the DAG's fields as Python
// objects, built from the compact result when asked for (nereus_rl/transition_native.py
// makes them lazy).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>

#include "transition/native_dag.h"

namespace py = pybind11;

namespace nereus_rl {
namespace transition {

void NativeDag::set_durations(const std::vector<double>& d) {
  if (d.size() != c.prims.size()) throw py::value_error("one duration per primitive needed");
  dur = d;
}

void NativeDag::do_refine() {
  if (dur.size() != c.prims.size()) throw py::value_error("set the durations first");
  chosen = refine(pb, c, dur, &alts);
}

double NativeDag::completion(const std::vector<double>& d) const {
  if (d.size() != c.prims.size()) throw py::value_error("one duration per primitive needed");
  return longest_path(c, dag(), d, nullptr);
}

PyObject* NativeDag::state(int s) const {
  if (s < pb.num_models)
    return make_tuple(nullptr, {PyUnicode_FromString("weights"), new_ref(models[s].ptr())});
  return make_tuple(nullptr, {PyUnicode_FromString("optimizer"), stage(s - pb.num_models)});
}
PyObject* NativeDag::slot(int key) const {
  return make_tuple(nullptr, {stage(key / pb.num_devices), dev(key % pb.num_devices)});
}

py::tuple NativeDag::primitives(py::object cls) {
  static const char* kKinds[4] = {"extend", "destroy", "split", "merge"};
  py::tuple out(c.prims.size());
  for (size_t p = 0; p < c.prims.size(); ++p) {
    const Prim& pr = c.prims[p];
    auto units_of = [&](const SmallVec<int, 2>& us) {
      PyObject* t = PyTuple_New(Py_ssize_t(us.size()));
      for (size_t i = 0; i < us.size(); ++i) PyTuple_SET_ITEM(t, i, unit(us[i]));
      return t;
    };
    auto bytes_of = [&](const SmallVec<int, 2>& us, bool skip_lost) {
      size_t k = 0;
      for (int u : us)
        for (int d : pb.units[u].dev) k += !(skip_lost && pb.lostdev[d]);
      PyObject* t = PyTuple_New(Py_ssize_t(k));
      k = 0;
      for (int u : us)
        for (int d : pb.units[u].dev)
          if (!(skip_lost && pb.lostdev[d]))
            PyTuple_SET_ITEM(t, k++, make_tuple(nullptr, {dev(d), new_ref(mems[u].ptr())}));
      return t;
    };
    PyObject* src = pr.source >= 0 ? unit(pr.source) : new_ref(Py_None);
    out[p] = py::reinterpret_steal<py::object>(make_tuple(
        cls.ptr(),
        {PyLong_FromSize_t(p), PyUnicode_InternFromString(kKinds[pr.kind]), stage(pr.stage),
         units_of(pr.ins), units_of(pr.outs), src, bytes_of(pr.outs, false), bytes_of(pr.ins, true),
         new_ref(pr.lost ? Py_True : Py_False)}));
  }
  return out;
}

PyObject* NativeDag::reason(const Edge& e) {
  switch (e.why) {
    case kCreatedBeforeCopy:
      return PyUnicode_FromFormat("%U is created before copy",
                                  PyTuple_GET_ITEM(unit_obj(e.arg), kUid));
    case kLivesUntilCopied:
      return PyUnicode_FromFormat("%U lives until copied", PyTuple_GET_ITEM(unit_obj(e.arg), kUid));
    case kCreatedBeforeMerge:
      return PyUnicode_FromFormat("%U is created before merge",
                                  PyTuple_GET_ITEM(unit_obj(e.arg), kUid));
    case kHolds: {
      bool w = e.arg2 < pb.num_models;
      PyObject* name = w ? models[e.arg2].ptr() : stages[e.arg2 - pb.num_models].ptr();
      return PyUnicode_FromFormat("%U holds %s of %U", PyTuple_GET_ITEM(unit_obj(e.arg), kUid),
                                  w ? "weights" : "optimizer", name);
    }
    case kRbaDevice:
      return PyUnicode_FromFormat("release-before-acquire on device %S", devs[e.arg].ptr());
    case kRbaSlot:
      return PyUnicode_FromFormat("release-before-acquire on slot %U@%S",
                                  stages[e.arg / pb.num_devices].ptr(),
                                  devs[e.arg % pb.num_devices].ptr());
  }
  return nullptr;
}

py::tuple NativeDag::edges(py::object cls) {
  const Dag& g = dag();
  py::tuple out(g.edges.size());
  PyObject* data = PyUnicode_InternFromString("data");
  PyObject* res = PyUnicode_InternFromString("resource");
  for (size_t i = 0; i < g.edges.size(); ++i) {
    const Edge& e = g.edges[i];
    out[i] = py::reinterpret_steal<py::object>(make_tuple(
        cls.ptr(),
        {PyLong_FromLong(e.src), PyLong_FromLong(e.dst), new_ref(e.data ? data : res), reason(e)}));
  }
  Py_DECREF(data);
  Py_DECREF(res);
  return out;
}

py::tuple NativeDag::order() const {
  const Dag& g = dag();
  py::tuple out(g.order.size());
  for (size_t i = 0; i < g.order.size(); ++i) out[i] = py::int_(g.order[i]);
  return out;
}

py::tuple NativeDag::funding(py::object cls) {
  const Dag& g = dag();
  py::tuple out(g.funding.size());
  for (size_t i = 0; i < g.funding.size(); ++i) {
    const Funding& f = g.funding[i];
    out[i] = py::reinterpret_steal<py::object>(
        make_tuple(cls.ptr(), {PyLong_FromLong(f.pid), f.slot ? slot(f.res) : dev(f.res),
                               PyLong_FromLong(f.funder), PyFloat_FromDouble(f.amount)}));
  }
  return out;
}

py::tuple NativeDag::anchors() {
  py::tuple out(c.anchors.size());
  for (size_t i = 0; i < c.anchors.size(); ++i) {
    auto [p, s, u] = c.anchors[i];
    out[i] = py::reinterpret_steal<py::object>(
        make_tuple(nullptr, {PyLong_FromLong(p), state(s), uid(u)}));
  }
  return out;
}

py::tuple NativeDag::early() const {
  py::tuple out(c.early.size());
  for (size_t i = 0; i < c.early.size(); ++i)
    out[i] = py::make_tuple(c.early[i].first, c.early[i].second);
  return out;
}

py::tuple NativeDag::unit_bytes() {
  std::vector<std::pair<std::string_view, int>> by_uid;
  for (size_t u = 0; u < pb.units.size(); ++u)
    by_uid.emplace_back(utf8(PyTuple_GET_ITEM(unit_obj(int(u)), kUid)), int(u));
  std::sort(by_uid.begin(), by_uid.end());  // UTF-8 order is code point order
  py::tuple out(by_uid.size());
  for (size_t i = 0; i < by_uid.size(); ++i) {
    int u = by_uid[i].second;
    out[i] =
        py::reinterpret_steal<py::object>(make_tuple(nullptr, {uid(u), new_ref(mems[u].ptr())}));
  }
  return out;
}

namespace {

std::unique_ptr<NativeDag> front_py(py::object current, bool from_plan, py::tuple target,
                                    py::object devices, py::list lost, py::object unit_cls) {
  auto nd = std::make_unique<NativeDag>();
  nd->front(current, from_plan, target, devices, lost, unit_cls);
  return nd;
}

py::tuple units_from_plan(py::tuple stages, py::object unit_cls) {
  auto nd = std::make_unique<NativeDag>();
  nd->front(stages, true, py::tuple(), py::none(), py::list(), unit_cls);
  return nd->current_units();
}

}  // namespace
}  // namespace transition

void register_transition(py::module_& m) {
  using transition::NativeDag;
  py::class_<NativeDag>(m, "TransitionNative",
                        "One compiled transition: the plan diff, the simulation, the refinement "
                        "and the DAG's fields built on request")
      .def_property_readonly("status", &NativeDag::status)
      .def_property_readonly("num_primitives", [](const NativeDag& n) { return n.c.prims.size(); })
      .def_property_readonly("refined", [](const NativeDag& n) { return n.chosen >= 0; })
      .def_property_readonly("has_durations", [](const NativeDag& n) { return !n.dur.empty(); })
      .def("memory_units", &NativeDag::memory_units)
      .def("set_memory", &NativeDag::set_memory, py::arg("values"))
      .def("layout_units", &NativeDag::layout_units)
      .def("set_layout_memory", &NativeDag::set_layout_memory, py::arg("values"))
      .def("current_units", &NativeDag::current_units)
      .def("target_units", &NativeDag::target_units)
      .def("exist_devices", &NativeDag::exist_devices)
      .def("simulate", &NativeDag::run_simulation, py::arg("cap"), py::arg("scalar"),
           py::arg("stage_slots"))
      .def("set_durations", &NativeDag::set_durations, py::arg("durations"))
      .def("set_table_durations", &NativeDag::table, py::arg("extend_setup"),
           py::arg("extend_bytes_per_s"), py::arg("reshard_setup"), py::arg("reshard_bytes_per_s"),
           py::arg("destroy_s"))
      .def("durations", [](const NativeDag& n) { return n.dur; })
      .def("refine", &NativeDag::do_refine)
      .def("completion_time", &NativeDag::completion, py::arg("durations"))
      .def("completion_time_set", &NativeDag::completion_set)
      .def("primitives", &NativeDag::primitives, py::arg("cls"))
      .def("edges", &NativeDag::edges, py::arg("cls"))
      .def("order", &NativeDag::order)
      .def("funding", &NativeDag::funding, py::arg("cls"))
      .def("anchors", &NativeDag::anchors)
      .def("early_destroys", &NativeDag::early)
      .def("unit_bytes", &NativeDag::unit_bytes);
  m.def("transition_front", &transition::front_py, py::arg("current"), py::arg("from_plan"),
        py::arg("target_stages"), py::arg("devices"), py::arg("lost_devices"), py::arg("unit_cls"),
        "Reads a transition (current units, or a current plan's stages with from_plan), checks "
        "its devices and runs the plan diff (see nereus_rl.transition_native); status != 0: "
        "the Python compiler must raise (or, -1, compile it)");
  m.def("transition_units_from_plan", &transition::units_from_plan, py::arg("stages"),
        py::arg("unit_cls"), "Placement.from_plan's units: '<stage>#<i>' per stage unit");
}

}  // namespace nereus_rl
