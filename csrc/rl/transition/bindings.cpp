// Bindings of the compiled transition DAG compiler: the inputs are marshalled once from
// the Python Unit objects (read straight from their tuples), the DAG's Python objects are
// built here from the compact result, each field on request (nereus_rl/transition_native.py
// makes them lazy).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "transition/dag.h"
#include "transition/diff.h"

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

/// Dense device indices: a table for small non-negative ids, a hash map otherwise.
class Devices {
 public:
  Devices(py::list* objs, std::vector<int64_t>* ids) : objs_(objs), ids_(ids) {}
  int id(PyObject* o) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v >= 0 && v < (1 << 20)) {
      if (size_t(v) >= table_.size()) table_.resize(std::max(size_t(v) + 1, table_.size() * 2), -1);
      int& slot = table_[size_t(v)];
      if (slot < 0) slot = add(o, v);
      return slot;
    }
    auto [it, fresh] = map_.emplace(v, -1);
    if (fresh) it->second = add(o, v);
    return it->second;
  }

 private:
  int add(PyObject* o, long long v) {
    objs_->append(py::reinterpret_borrow<py::object>(o));
    ids_->push_back(v);
    return int(ids_->size()) - 1;
  }
  py::list* objs_;
  std::vector<int64_t>* ids_;
  std::vector<int> table_;
  std::unordered_map<long long, int> map_;
};

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
  std::vector<int64_t> dev_id;           // per dense device: its id
  std::unique_ptr<Devices> device_index;
  py::list keep;       // the target stages' fields, referenced by raw pointers
  py::list units_all;  // every unit object, current then created
  DiffResult diff;
  std::vector<int> layout_of;   // per unit: its (model, trains, tp, pp) group
  std::vector<int> layout_rep;  // per group: its first unit in memory order

  int status() const { return diff.status != kOk ? diff.status : c.status; }

  py::list memory_units() const {
    py::list out(diff.memory_order.size());
    for (size_t i = 0; i < diff.memory_order.size(); ++i) out[i] = units[diff.memory_order[i]];
    return out;
  }
  void set_memory(py::list values) {
    if (values.size() != diff.memory_order.size()) throw py::value_error("one value per unit");
    mems = py::list(pb.units.size());
    for (size_t i = 0; i < diff.memory_order.size(); ++i) {
      int u = diff.memory_order[i];
      mems[u] = values[i];
      pb.units[u].mem = values[i].cast<double>();
    }
  }
  py::list layout_units() {
    std::unordered_map<uint64_t, int> group;
    layout_of.assign(pb.units.size(), -1);
    layout_rep.clear();
    for (int u : diff.memory_order) {
      const Unit& x = pb.units[u];
      uint64_t key = (uint64_t(x.model) << 42) ^ (uint64_t(x.trains) << 41) ^
                     (uint64_t(x.tp) << 20) ^ uint64_t(x.pp);
      auto [it, fresh] = group.emplace(key, int(layout_rep.size()));
      if (fresh) layout_rep.push_back(u);
      layout_of[u] = it->second;
    }
    py::list out(layout_rep.size());
    for (size_t g = 0; g < layout_rep.size(); ++g) out[g] = units[layout_rep[g]];
    return out;
  }
  void set_layout_memory(py::list values) {
    if (values.size() != layout_rep.size()) throw py::value_error("one value per layout");
    mems = py::list(pb.units.size());
    std::vector<double> v(values.size());
    for (size_t g = 0; g < values.size(); ++g) v[g] = values[g].cast<double>();
    for (size_t u = 0; u < pb.units.size(); ++u) {
      PyList_SET_ITEM(mems.ptr(), u, new_ref(PyList_GET_ITEM(values.ptr(), layout_of[u])));
      pb.units[u].mem = v[layout_of[u]];
    }
  }
  py::tuple target_units() const {
    py::tuple out(pb.target_units.size());
    for (size_t i = 0; i < pb.target_units.size(); ++i) out[i] = units[pb.target_units[i]];
    return out;
  }
  void run_simulation(py::list exist, std::vector<double> cap, bool stage_slots) {
    pb.stage_slots = stage_slots;
    pb.exist_order.clear();
    for (auto d : exist) pb.exist_order.push_back(device_index->id(d.ptr()));
    pb.num_devices = int(dev_id.size());
    pb.lostdev.resize(pb.num_devices, 0);
    pb.exist.assign(pb.num_devices, 0);
    pb.touched.assign(pb.num_devices, 0);
    pb.cap.assign(pb.num_devices, 0.0);
    for (size_t i = 0; i < pb.exist_order.size(); ++i) {
      pb.exist[pb.exist_order[i]] = 1;
      pb.cap[pb.exist_order[i]] = cap[i];
    }
    for (Unit& x : pb.units) {
      x.state[0] = x.model;
      x.num_states = x.trains ? 2 : 1;
      x.state[1] = pb.num_models + x.stage;
    }
    auto touch = [&](int u) {
      for (int d : pb.units[u].dev) pb.touched[d] = 1;
    };
    for (int u : pb.lost_units) touch(u);
    for (int u : pb.destroys) touch(u);
    for (int u : pb.extends) touch(u);
    for (auto& s : pb.splits) touch(s[0]), touch(s[1]), touch(s[2]);
    for (auto& s : pb.relayouts) touch(s[0]), touch(s[1]), touch(s[2]), touch(s[3]);
    for (auto& s : pb.merges) touch(s[0]), touch(s[1]), touch(s[2]);
    c = simulate(pb);
  }

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

PyObject* new_unit(PyObject* cls, PyObject* uid, PyObject* stage, PyObject* model, PyObject* trains,
                   PyObject* tp, PyObject* pp, PyObject* devices) {
  return make_tuple(cls, {uid, new_ref(stage), new_ref(model), new_ref(trains), tp, pp, devices});
}

// The plan diff of the current units (a tuple of Units) and the target stages.
std::unique_ptr<NativeDag> diff_py(py::tuple cur, py::tuple target, py::list lost_devices,
                                   py::object unit_cls) {
  auto nd = std::make_unique<NativeDag>();
  nd->device_index = std::make_unique<Devices>(&nd->devs, &nd->dev_id);
  Devices& devices = *nd->device_index;
  Problem& pb = nd->pb;
  Names stages(&nd->stages), models(&nd->models);
  struct Plan {
    PyObject *stage, *model, *trains, *tp, *pp, *units;
  };
  std::vector<Plan> plans;
  for (auto sp : target) {
    Plan p{};
    PyObject** slots[6] = {&p.stage, &p.model, &p.trains, &p.tp, &p.pp, &p.units};
    const char* names[6] = {"stage", "model", "trains", "tp", "pp", "units"};
    for (int i = 0; i < 6; ++i) {
      *slots[i] = PyObject_GetAttrString(sp.ptr(), names[i]);
      if (!*slots[i]) throw py::error_already_set();
      nd->keep.append(py::reinterpret_steal<py::object>(*slots[i]));
    }
    stages.id(p.stage);
    plans.push_back(p);
  }
  const size_t ncur = cur.size();
  pb.num_current = int(ncur);
  pb.units.resize(ncur);
  nd->units = py::list(ncur);
  std::unordered_set<std::string_view> uids;
  uids.reserve(ncur * 2);
  for (size_t i = 0; i < ncur; ++i) {
    PyObject* o = PyTuple_GET_ITEM(cur.ptr(), i);
    Unit& x = pb.units[i];
    PyList_SET_ITEM(nd->units.ptr(), i, new_ref(o));
    uids.insert(utf8(PyTuple_GET_ITEM(o, kUid)));
    x.stage = stages.id(PyTuple_GET_ITEM(o, kStage));
    x.model = models.id(PyTuple_GET_ITEM(o, kModel));
    x.trains = PyObject_IsTrue(PyTuple_GET_ITEM(o, kTrains));
    x.tp = int(PyLong_AsLong(PyTuple_GET_ITEM(o, 4)));
    x.pp = int(PyLong_AsLong(PyTuple_GET_ITEM(o, 5)));
    PyObject* ds = PyTuple_GET_ITEM(o, kDevices);
    Py_ssize_t k = PySequence_Fast_GET_SIZE(ds);
    x.dev.resize(k);
    for (Py_ssize_t j = 0; j < k; ++j) x.dev[j] = devices.id(PySequence_Fast_GET_ITEM(ds, j));
  }
  std::vector<TargetStage> tstages;
  for (const Plan& p : plans) {
    TargetStage t;
    t.stage = stages.id(p.stage);
    t.model = models.id(p.model);
    t.trains = PyObject_IsTrue(p.trains);
    t.tp = int(PyLong_AsLong(p.tp));
    t.pp = int(PyLong_AsLong(p.pp));
    PyObject* us = PySequence_Fast(p.units, "StagePlan.units must be a tuple");
    if (!us) throw py::error_already_set();
    t.units.resize(PySequence_Fast_GET_SIZE(us));
    for (size_t j = 0; j < t.units.size(); ++j) {
      PyObject* u = PySequence_Fast_GET_ITEM(us, j);
      Py_ssize_t k = PySequence_Fast_GET_SIZE(u);
      t.units[j].resize(k);
      for (Py_ssize_t i = 0; i < k; ++i) t.units[j][i] = devices.id(PySequence_Fast_GET_ITEM(u, i));
    }
    Py_DECREF(us);
    tstages.push_back(std::move(t));
  }
  pb.num_stages = stages.size();
  pb.num_models = models.size();
  pb.num_devices = int(nd->dev_id.size());
  pb.lostdev.assign(pb.num_devices, 0);
  for (auto d : lost_devices) {
    // a lost device no unit uses changes nothing
    long long v = PyLong_AsLongLong(d.ptr());
    for (size_t i = 0; i < nd->dev_id.size(); ++i)
      if (nd->dev_id[i] == v) pb.lostdev[i] = 1;
  }
  std::string name;
  auto taken = [&](int stage, int k) {
    name.assign(utf8(nd->stages[stage].ptr()));
    name += '#';
    name += std::to_string(k);
    return uids.count(name) > 0;
  };
  nd->diff = diff_plans(pb, tstages, nd->dev_id, taken);
  if (nd->diff.status != kOk) return nd;
  // The created units' Python objects.
  nd->units_all = py::list(pb.units.size());
  for (size_t i = 0; i < ncur; ++i)
    PyList_SET_ITEM(nd->units_all.ptr(), i, new_ref(PyList_GET_ITEM(nd->units.ptr(), i)));
  for (const Origin& o : nd->diff.origin) {
    PyObject* obj;
    if (o.kind == Origin::kTarget) {
      const Plan& p = plans[o.a];
      PyObject* uid = PyUnicode_FromFormat("%U#%d", p.stage, o.c);
      PyObject* devs = PyTuple_GET_ITEM(p.units, o.b);
      obj = new_unit(unit_cls.ptr(), uid, p.stage, p.model, p.trains, new_ref(p.tp), new_ref(p.pp),
                     new_ref(devs));
    } else {
      PyObject* base = PyList_GET_ITEM(nd->units.ptr(), o.a);
      std::string_view buid = utf8(PyTuple_GET_ITEM(base, kUid));
      PyObject* uid = PyUnicode_FromFormat("%U%s", PyTuple_GET_ITEM(base, kUid),
                                           o.kind == Origin::kHalfA ? "a" : "b");
      if (uids.count(std::string(buid) + (o.kind == Origin::kHalfA ? "a" : "b"))) {
        Py_DECREF(uid);
        nd->diff.status = -1;  // a half would reuse a current uid: the Python path
        return nd;
      }
      const Unit& h = pb.units[o.unit];
      PyObject* ds = PyTuple_GET_ITEM(base, kDevices);
      Py_ssize_t n = PySequence_Fast_GET_SIZE(ds), half = n / 2;
      PyObject* devs = o.kind == Origin::kHalfA ? PySequence_GetSlice(ds, 0, half)
                                                : PySequence_GetSlice(ds, half, n);
      obj = new_unit(unit_cls.ptr(), uid, PyTuple_GET_ITEM(base, kStage),
                     PyTuple_GET_ITEM(base, kModel), PyTuple_GET_ITEM(base, kTrains),
                     PyLong_FromLong(h.tp), PyLong_FromLong(h.pp), devs);
    }
    PyList_SET_ITEM(nd->units_all.ptr(), o.unit, obj);
  }
  nd->units = nd->units_all;
  return nd;
}

py::tuple units_from_plan(py::tuple stages, py::object unit_cls) {
  std::vector<PyObject*> out;
  for (auto sp : stages) {
    py::object stage = sp.attr("stage"), model = sp.attr("model"), trains = sp.attr("trains");
    py::object tp = sp.attr("tp"), pp = sp.attr("pp");
    py::tuple us = sp.attr("units");
    for (size_t i = 0; i < us.size(); ++i)
      out.push_back(new_unit(unit_cls.ptr(), PyUnicode_FromFormat("%U#%zu", stage.ptr(), i),
                             stage.ptr(), model.ptr(), trains.ptr(), new_ref(tp.ptr()),
                             new_ref(pp.ptr()), new_ref(us[i].ptr())));
  }
  py::tuple t(out.size());
  for (size_t i = 0; i < out.size(); ++i) PyTuple_SET_ITEM(t.ptr(), i, out[i]);
  return t;
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
      .def("target_units", &NativeDag::target_units)
      .def("simulate", &NativeDag::run_simulation, py::arg("exist"), py::arg("cap"),
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
  m.def("transition_diff", &transition::diff_py, py::arg("current_units"), py::arg("target_stages"),
        py::arg("lost_devices"), py::arg("unit_cls"),
        "The plan diff of a transition (see nereus_rl.transition_native); status != 0 means "
        "the Python compiler must raise (or, -1, compile it)");
  m.def("transition_units_from_plan", &transition::units_from_plan, py::arg("stages"),
        py::arg("unit_cls"), "Placement.from_plan's units: '<stage>#<i>' per stage unit");
}

}  // namespace nereus_rl
