// Bindings of the compiled transition DAG compiler: the inputs are marshalled once from
// the Python Unit objects (read straight from their tuples), the DAG's Python objects are
// built here from the compact result, each field on request (nereus_rl/transition_native.py
// makes them lazy).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "transition/dag.h"

namespace py = pybind11;

namespace nereus_rl {
namespace transition {
namespace {

// Fields of nereus_rl.transition.Unit (a NamedTuple).
enum UnitField { kUid = 0, kStage = 1, kModel = 2, kTrains = 3, kDevices = 6 };

PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

// A tuple subclass instance (a NamedTuple) that takes the references in items.
PyObject* make_tuple(PyObject* cls, std::initializer_list<PyObject*> items) {
  PyObject* t = cls ? reinterpret_cast<PyTypeObject*>(cls)->tp_alloc(
                          reinterpret_cast<PyTypeObject*>(cls), Py_ssize_t(items.size()))
                    : PyTuple_New(Py_ssize_t(items.size()));
  if (!t) throw py::error_already_set();
  Py_ssize_t i = 0;
  for (PyObject* x : items) {
    if (!x) throw py::error_already_set();
    PyTuple_SET_ITEM(t, i++, x);
  }
  return t;
}

std::string_view utf8(PyObject* s) {
  Py_ssize_t n = 0;
  const char* c = PyUnicode_AsUTF8AndSize(s, &n);
  if (!c) throw py::error_already_set();
  return {c, size_t(n)};
}

/// One compile: the problem, the simulation, the refinements and the Python objects
/// needed to build the DAG's fields.
class NativeDag {
 public:
  Problem pb;
  Compiled c;
  std::vector<Dag> alts;
  int chosen = -1;  // -1: the simulation's DAG
  std::vector<double> dur;
  py::list units, devs, stages, models;  // by index: Unit objects, device ints, names
  py::list mems;                         // per unit: its bytes (a float object)

  const Dag& dag() const { return chosen < 0 ? c.sim : alts[chosen]; }

  void set_durations(const std::vector<double>& d) {
    if (d.size() != c.prims.size()) throw py::value_error("one duration per primitive needed");
    dur = d;
  }
  void table(double es, double ebw, double rs, double rbw, double ds) {
    dur = table_costs(c, es, ebw, rs, rbw, ds);
  }
  void do_refine() {
    if (dur.size() != c.prims.size()) throw py::value_error("set the durations first");
    chosen = refine(pb, c, dur, &alts);
  }
  double completion(const std::vector<double>& d) const {
    if (d.size() != c.prims.size()) throw py::value_error("one duration per primitive needed");
    return longest_path(c, dag(), d, nullptr);
  }
  double completion_set() const { return completion(dur); }

  PyObject* dev(int d) const { return new_ref(devs[d].ptr()); }
  PyObject* unit(int u) const { return new_ref(units[u].ptr()); }
  PyObject* uid(int u) const { return new_ref(PyTuple_GET_ITEM(units[u].ptr(), kUid)); }
  PyObject* stage(int s) const { return new_ref(stages[s].ptr()); }
  PyObject* state(int s) const {
    if (s < pb.num_models)
      return make_tuple(nullptr, {PyUnicode_FromString("weights"), new_ref(models[s].ptr())});
    return make_tuple(nullptr, {PyUnicode_FromString("optimizer"), stage(s - pb.num_models)});
  }
  PyObject* slot(int key) const {
    return make_tuple(nullptr, {stage(key / pb.num_devices), dev(key % pb.num_devices)});
  }

  py::tuple primitives(py::object cls) const {
    static const char* kKinds[4] = {"extend", "destroy", "split", "merge"};
    py::tuple out(c.prims.size());
    for (size_t p = 0; p < c.prims.size(); ++p) {
      const Prim& pr = c.prims[p];
      auto units_of = [&](const std::vector<int>& us) {
        PyObject* t = PyTuple_New(Py_ssize_t(us.size()));
        for (size_t i = 0; i < us.size(); ++i) PyTuple_SET_ITEM(t, i, unit(us[i]));
        return t;
      };
      auto bytes_of = [&](const std::vector<int>& us, bool skip_lost) {
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
           units_of(pr.ins), units_of(pr.outs), src, bytes_of(pr.outs, false),
           bytes_of(pr.ins, true), new_ref(pr.lost ? Py_True : Py_False)}));
    }
    return out;
  }

  PyObject* reason(const Edge& e) const {
    switch (e.why) {
      case kCreatedBeforeCopy:
        return PyUnicode_FromFormat("%U is created before copy",
                                    PyTuple_GET_ITEM(units[e.arg].ptr(), kUid));
      case kLivesUntilCopied:
        return PyUnicode_FromFormat("%U lives until copied",
                                    PyTuple_GET_ITEM(units[e.arg].ptr(), kUid));
      case kCreatedBeforeMerge:
        return PyUnicode_FromFormat("%U is created before merge",
                                    PyTuple_GET_ITEM(units[e.arg].ptr(), kUid));
      case kHolds: {
        bool w = e.arg2 < pb.num_models;
        PyObject* name = w ? models[e.arg2].ptr() : stages[e.arg2 - pb.num_models].ptr();
        return PyUnicode_FromFormat("%U holds %s of %U", PyTuple_GET_ITEM(units[e.arg].ptr(), kUid),
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

  py::tuple edges(py::object cls) const {
    const Dag& g = dag();
    py::tuple out(g.edges.size());
    PyObject* data = PyUnicode_InternFromString("data");
    PyObject* res = PyUnicode_InternFromString("resource");
    for (size_t i = 0; i < g.edges.size(); ++i) {
      const Edge& e = g.edges[i];
      out[i] = py::reinterpret_steal<py::object>(
          make_tuple(cls.ptr(), {PyLong_FromLong(e.src), PyLong_FromLong(e.dst),
                                 new_ref(e.data ? data : res), reason(e)}));
    }
    Py_DECREF(data);
    Py_DECREF(res);
    return out;
  }

  py::tuple order() const {
    const Dag& g = dag();
    py::tuple out(g.order.size());
    for (size_t i = 0; i < g.order.size(); ++i) out[i] = py::int_(g.order[i]);
    return out;
  }

  py::tuple funding(py::object cls) const {
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

  py::tuple anchors() const {
    py::tuple out(c.anchors.size());
    for (size_t i = 0; i < c.anchors.size(); ++i) {
      auto [p, s, u] = c.anchors[i];
      out[i] = py::reinterpret_steal<py::object>(
          make_tuple(nullptr, {PyLong_FromLong(p), state(s), uid(u)}));
    }
    return out;
  }

  py::tuple early() const {
    py::tuple out(c.early.size());
    for (size_t i = 0; i < c.early.size(); ++i)
      out[i] = py::make_tuple(c.early[i].first, c.early[i].second);
    return out;
  }

  py::tuple unit_bytes() const {
    std::vector<std::pair<std::string_view, int>> by_uid;
    for (size_t u = 0; u < pb.units.size(); ++u)
      by_uid.emplace_back(utf8(PyTuple_GET_ITEM(units[u].ptr(), kUid)), int(u));
    std::sort(by_uid.begin(), by_uid.end());  // UTF-8 order is code point order
    py::tuple out(by_uid.size());
    for (size_t i = 0; i < by_uid.size(); ++i) {
      int u = by_uid[i].second;
      out[i] =
          py::reinterpret_steal<py::object>(make_tuple(nullptr, {uid(u), new_ref(mems[u].ptr())}));
    }
    return out;
  }
};

// Dense ids for Python objects: by identity first (names of one plan are shared
// objects), then by value.
class Names {
 public:
  explicit Names(py::list* out) : out_(out) {}
  int id(PyObject* s) {
    auto it = by_ptr_.find(s);
    if (it != by_ptr_.end()) return it->second;
    auto [jt, fresh] = by_value_.emplace(std::string(utf8(s)), int(out_->size()));
    if (fresh) out_->append(py::reinterpret_borrow<py::object>(s));
    by_ptr_.emplace(s, jt->second);
    return jt->second;
  }
  int size() const { return int(by_value_.size()); }

 private:
  py::list* out_;
  std::unordered_map<PyObject*, int> by_ptr_;
  std::unordered_map<std::string, int> by_value_;
};

std::unique_ptr<NativeDag> simulate_py(py::list units, py::list mems, int num_current,
                                       py::list target_stages, py::tuple lost, py::tuple splits,
                                       py::tuple relayouts, py::tuple merges, py::tuple extends,
                                       py::tuple destroys, py::tuple target_units, py::list exist,
                                       std::vector<double> cap, py::list lost_devices,
                                       bool stage_slots) {
  auto nd = std::make_unique<NativeDag>();
  Problem& pb = nd->pb;
  nd->units = units;
  nd->mems = mems;
  pb.stage_slots = stage_slots;
  pb.num_current = num_current;
  std::unordered_map<long long, int> dense;
  auto dev_id = [&](PyObject* o) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    auto [it, fresh] = dense.emplace(v, int(nd->devs.size()));
    if (fresh) nd->devs.append(py::reinterpret_borrow<py::object>(o));
    return it->second;
  };
  for (auto d : exist) pb.exist_order.push_back(dev_id(d.ptr()));
  for (auto d : lost_devices) dev_id(d.ptr());
  Names stages(&nd->stages), models(&nd->models);
  for (auto s : target_stages) stages.id(s.ptr());
  const size_t nu = units.size();
  pb.units.resize(nu);
  std::unordered_map<PyObject*, int> index;
  std::unordered_set<std::string_view> uids;
  for (size_t i = 0; i < nu; ++i) {
    PyObject* o = units[i].ptr();
    Unit& x = pb.units[i];
    index.emplace(o, int(i));
    if (!uids.insert(utf8(PyTuple_GET_ITEM(o, kUid))).second) {
      nd->c.status = -1;  // two units share a uid: the Python compiler handles it
      return nd;
    }
    x.stage = stages.id(PyTuple_GET_ITEM(o, kStage));
    x.model = models.id(PyTuple_GET_ITEM(o, kModel));
    x.trains = PyObject_IsTrue(PyTuple_GET_ITEM(o, kTrains));
    PyObject* ds = PyTuple_GET_ITEM(o, kDevices);
    Py_ssize_t k = PySequence_Fast_GET_SIZE(ds);
    x.dev.resize(k);
    for (Py_ssize_t j = 0; j < k; ++j) x.dev[j] = dev_id(PySequence_Fast_GET_ITEM(ds, j));
    x.mem = PyFloat_AsDouble(mems[i].ptr());
  }
  pb.num_stages = stages.size();
  pb.num_models = models.size();
  for (Unit& x : pb.units) {
    x.state[0] = x.model;
    x.num_states = x.trains ? 2 : 1;
    x.state[1] = pb.num_models + x.stage;
  }
  pb.num_devices = int(nd->devs.size());
  pb.exist.assign(pb.num_devices, 0);
  pb.lostdev.assign(pb.num_devices, 0);
  pb.touched.assign(pb.num_devices, 0);
  pb.cap.assign(pb.num_devices, 0.0);
  for (size_t i = 0; i < pb.exist_order.size(); ++i) {
    pb.exist[pb.exist_order[i]] = 1;
    pb.cap[pb.exist_order[i]] = cap[i];
  }
  for (auto d : lost_devices) pb.lostdev[dense.at(PyLong_AsLongLong(d.ptr()))] = 1;
  auto idx = [&](py::handle o) {
    auto it = index.find(o.ptr());
    if (it == index.end()) throw py::value_error("a unit of the diff is missing from units");
    return it->second;
  };
  auto touch = [&](int u) {
    for (int d : pb.units[u].dev) pb.touched[d] = 1;
  };
  for (auto u : lost) pb.lost_units.push_back(idx(u));
  for (auto s : splits) {
    auto t = s.cast<py::tuple>();
    auto h = t[1].cast<py::tuple>();
    pb.splits.push_back({idx(t[0]), idx(h[0]), idx(h[1])});
  }
  for (auto s : relayouts) {
    auto t = s.cast<py::tuple>();
    auto h = t[1].cast<py::tuple>();
    pb.relayouts.push_back({idx(t[0]), idx(h[0]), idx(h[1]), idx(t[2])});
  }
  for (auto s : merges) {
    auto t = s.cast<py::tuple>();
    auto h = t[0].cast<py::tuple>();
    pb.merges.push_back({idx(h[0]), idx(h[1]), idx(t[1])});
  }
  for (auto u : extends) pb.extends.push_back(idx(u));
  for (auto u : destroys) pb.destroys.push_back(idx(u));
  for (auto u : target_units) pb.target_units.push_back(idx(u));
  // Devices some primitive acquires or releases.
  for (int u : pb.lost_units) touch(u);
  for (int u : pb.destroys) touch(u);
  for (int u : pb.extends) touch(u);
  for (auto& s : pb.splits) touch(s[0]), touch(s[1]), touch(s[2]);
  for (auto& s : pb.relayouts) touch(s[0]), touch(s[1]), touch(s[2]), touch(s[3]);
  for (auto& s : pb.merges) touch(s[0]), touch(s[1]), touch(s[2]);
  nd->c = simulate(pb);
  return nd;
}

}  // namespace
}  // namespace transition

void register_transition(py::module_& m) {
  using transition::NativeDag;
  py::class_<NativeDag>(m, "TransitionNative",
                        "One compiled transition: status, durations, refinement and the DAG's "
                        "fields built on request")
      .def_property_readonly("status", [](const NativeDag& n) { return n.c.status; })
      .def_property_readonly("num_primitives", [](const NativeDag& n) { return n.c.prims.size(); })
      .def_property_readonly("refined", [](const NativeDag& n) { return n.chosen >= 0; })
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
  m.def("transition_simulate", &transition::simulate_py, py::arg("units"), py::arg("mems"),
        py::arg("num_current"), py::arg("target_stages"), py::arg("lost"), py::arg("splits"),
        py::arg("relayouts"), py::arg("merges"), py::arg("extends"), py::arg("destroys"),
        py::arg("target_units"), py::arg("exist"), py::arg("cap"), py::arg("lost_devices"),
        py::arg("stage_slots"),
        "The transition compiler's simulation on one plan diff (see "
        "nereus_rl.transition_native); status != 0 means the Python compiler must raise");
}

}  // namespace nereus_rl
