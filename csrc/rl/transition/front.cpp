// The front of the compiled transition compiler: the inputs read once from Python (the
// current units or plan, the target plan, the devices), the device checks of
// compile_transition, the plan diff, and the Unit objects built only when asked for.
#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "transition/native_dag.h"

namespace nereus_rl::transition {
namespace {

// Dense ids for names: by identity first (names of one plan are shared objects), then
// by value.
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

// Input checks: the reads below use CPython's unchecked macros (PyTuple_GET_ITEM,
// PySequence_Fast_GET_ITEM), so every object is checked for its type first and a
// malformed input raises TypeError/ValueError instead of reading out of bounds.
std::string type_name(PyObject* o) { return Py_TYPE(o)->tp_name; }

void need_tuple(PyObject* o, const std::string& what, Py_ssize_t min_size = 0) {
  if (!PyTuple_Check(o)) throw py::type_error(what + " must be a tuple, got " + type_name(o));
  if (PyTuple_GET_SIZE(o) < min_size)
    throw py::value_error(what + " must have at least " + std::to_string(min_size) +
                          " fields, got " + std::to_string(PyTuple_GET_SIZE(o)));
}

void need_str(PyObject* o, const std::string& what) {
  if (!PyUnicode_Check(o)) throw py::type_error(what + " must be a str, got " + type_name(o));
}

// A tp or pp degree: an int (not a bool) in 1..2^20.
int degree(PyObject* o, const std::string& what) {
  if (!PyIndex_Check(o) || PyBool_Check(o))
    throw py::type_error(what + " must be an int, got " + type_name(o));
  const long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (v < 1 || v > (1 << 20))
    throw py::value_error(what + " must be in 1..2^20, got " + std::to_string(v));
  return int(v);
}

bool truth(PyObject* o) {
  const int t = PyObject_IsTrue(o);
  if (t < 0) throw py::error_already_set();
  return t != 0;
}

// A plan stage's fields, type-checked: units a tuple of device lists or tuples.
PlanStage plan_stage(py::handle sp, py::list* keep) {
  PlanStage p{};
  PyObject** slots[6] = {&p.stage, &p.model, &p.trains, &p.tp, &p.pp, &p.units};
  const char* names[6] = {"stage", "model", "trains", "tp", "pp", "units"};
  for (int i = 0; i < 6; ++i) {
    *slots[i] = PyObject_GetAttrString(sp.ptr(), names[i]);
    if (!*slots[i]) throw py::error_already_set();
    keep->append(py::reinterpret_steal<py::object>(*slots[i]));
  }
  need_str(p.stage, "a plan stage's stage");
  need_str(p.model, "a plan stage's model");
  degree(p.tp, "a plan stage's tp");
  degree(p.pp, "a plan stage's pp");
  need_tuple(p.units, "a plan stage's units");
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p.units); ++i) {
    PyObject* devs = PyTuple_GET_ITEM(p.units, i);
    if (!PyList_Check(devs) && !PyTuple_Check(devs))
      throw py::type_error("a plan stage's unit devices must be a tuple or list, got " +
                           type_name(devs));
  }
  return p;
}

// A current unit: a tuple of at least kDevices + 1 fields, uid/stage/model str, tp/pp
// degrees, devices a tuple or list.
void check_unit(PyObject* u) {
  need_tuple(u, "a current unit", kDevices + 1);
  need_str(PyTuple_GET_ITEM(u, kUid), "a unit's uid");
  need_str(PyTuple_GET_ITEM(u, kStage), "a unit's stage");
  need_str(PyTuple_GET_ITEM(u, kModel), "a unit's model");
  degree(PyTuple_GET_ITEM(u, kTp), "a unit's tp");
  degree(PyTuple_GET_ITEM(u, kPp), "a unit's pp");
  PyObject* devs = PyTuple_GET_ITEM(u, kDevices);
  if (!PyList_Check(devs) && !PyTuple_Check(devs))
    throw py::type_error("a unit's devices must be a tuple or list, got " + type_name(devs));
}

template <typename V>
void read_devices(PyObject* seq, Devices& devices, V* out) {
  Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
  out->resize(k);
  for (Py_ssize_t j = 0; j < k; ++j) (*out)[j] = devices.id(PySequence_Fast_GET_ITEM(seq, j));
}

PyObject* new_unit(PyObject* cls, PyObject* uid, PyObject* stage, PyObject* model, PyObject* trains,
                   PyObject* tp, PyObject* pp, PyObject* devices) {
  return make_tuple(cls, {uid, new_ref(stage), new_ref(model), new_ref(trains), tp, pp, devices});
}

// "<stage>#<k>" without a format parser.
PyObject* numbered(PyObject* stage, long k) {
  std::string s(utf8(stage));
  s += '#';
  s += std::to_string(k);
  return PyUnicode_FromStringAndSize(s.data(), Py_ssize_t(s.size()));
}

}  // namespace

PyObject* make_tuple(PyObject* cls, std::initializer_list<PyObject*> items) {
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  PyObject* t =
      cls ? type->tp_alloc(type, Py_ssize_t(items.size())) : PyTuple_New(Py_ssize_t(items.size()));
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

void NativeDag::front(py::object current, bool plan, py::tuple target, py::object devices,
                      py::list lost, py::object cls) {
  if (!PyType_Check(cls.ptr()) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls.ptr()), &PyTuple_Type))
    throw py::type_error("unit_cls must be a tuple subclass (the Unit named tuple), got " +
                         type_name(cls.ptr()));
  from_plan = plan;
  unit_cls = cls;
  Names stage_ids(&stages), model_ids(&models);
  for (auto sp : target) {
    tgt_plans.push_back(plan_stage(sp, &keep));
    stage_ids.id(tgt_plans.back().stage);
  }
  auto& U = pb.units;
  std::unordered_set<std::string_view> uids;  // current uids (given as units)
  std::vector<int> count_of;                  // current units per stage (given as a plan)
  auto add_unit = [&](int stage, int model, bool trains, int tp, int pp, PyObject* devs) {
    U.emplace_back();
    Unit& x = U.back();
    x.stage = stage;
    x.model = model;
    x.trains = trains;
    x.tp = tp;
    x.pp = pp;
    read_devices(devs, device_index, &x.dev);
  };
  if (plan) {
    for (auto sp : current) {
      cur_plans.push_back(plan_stage(sp, &keep));
      const PlanStage& p = cur_plans.back();
      Py_ssize_t n = PyTuple_GET_SIZE(p.units);
      int s = stage_ids.id(p.stage), model = model_ids.id(p.model);
      bool trains = truth(p.trains);
      int tp = degree(p.tp, "tp"), pp = degree(p.pp, "pp");
      U.reserve(U.size() + n);
      for (Py_ssize_t i = 0; i < n; ++i) {
        add_unit(s, model, trains, tp, pp, PyTuple_GET_ITEM(p.units, i));
        cur_origin.emplace_back(int(cur_plans.size()) - 1, int(i));
      }
      if (int(count_of.size()) <= s) count_of.resize(s + 1, 0);
      count_of[s] = int(n);
    }
  } else {
    need_tuple(current.ptr(), "current (units)");
    auto units = py::reinterpret_borrow<py::tuple>(current);
    for (auto o : units) check_unit(o.ptr());
    uids.reserve(units.size() * 2);
    for (auto o : units) {
      PyObject* u = o.ptr();
      uids.insert(utf8(PyTuple_GET_ITEM(u, kUid)));
      add_unit(stage_ids.id(PyTuple_GET_ITEM(u, kStage)), model_ids.id(PyTuple_GET_ITEM(u, kModel)),
               truth(PyTuple_GET_ITEM(u, kTrains)), degree(PyTuple_GET_ITEM(u, kTp), "tp"),
               degree(PyTuple_GET_ITEM(u, kPp), "pp"), PyTuple_GET_ITEM(u, kDevices));
      objs.push_back(new_ref(u));
    }
  }
  pb.num_current = int(U.size());
  std::vector<TargetStage> tstages;
  for (const PlanStage& p : tgt_plans) {
    TargetStage t;
    t.stage = stage_ids.id(p.stage);
    t.model = model_ids.id(p.model);
    t.trains = truth(p.trains);
    t.tp = degree(p.tp, "tp");
    t.pp = degree(p.pp, "pp");
    t.units.resize(PyTuple_GET_SIZE(p.units));
    for (size_t j = 0; j < t.units.size(); ++j)
      read_devices(PyTuple_GET_ITEM(p.units, j), device_index, &t.units[j]);
    tstages.push_back(std::move(t));
  }
  pb.num_stages = stage_ids.size();
  pb.num_models = model_ids.size();
  // compile_transition's device sets: exist = (given - lost) | (current - lost).
  std::vector<int> lost_ids;
  for (auto d : lost) lost_ids.push_back(device_index.id(d.ptr()));
  std::vector<int> given_ids;
  if (!devices.is_none())
    for (auto d : devices) given_ids.push_back(device_index.id(d.ptr()));
  const int D = int(dev_id.size());
  pb.num_devices = D;
  pb.lostdev.assign(D, 0);
  for (int d : lost_ids) pb.lostdev[d] = 1;
  std::vector<char> in_cur(D, 0), in_tgt(D, 0), given(D, 0);
  for (int u = 0; u < pb.num_current; ++u)
    for (int d : U[u].dev) in_cur[d] = 1;
  for (auto& t : tstages)
    for (auto& us : t.units)
      for (int d : us) in_tgt[d] = 1;
  if (devices.is_none()) {
    for (int d = 0; d < D; ++d) given[d] = in_cur[d] || in_tgt[d];
  } else {
    for (int d : given_ids) given[d] = 1;
  }
  for (int d = 0; d < D; ++d) {
    bool after = given[d] && !pb.lostdev[d];
    if (in_tgt[d] && !after) front_status = kMissingDevice;
    if (after || (in_cur[d] && !pb.lostdev[d])) exist.push_back(d);
  }
  if (front_status != kOk) return;
  std::string name;
  auto taken = [&](int stage, int k) {
    if (plan) return stage < int(count_of.size()) && k < count_of[stage];
    name.assign(utf8(stages[stage].ptr()));
    name += '#';
    name += std::to_string(k);
    return uids.count(name) > 0;
  };
  diff = diff_plans(pb, tstages, dev_id, taken);
  if (diff.status != kOk) return;
  objs.resize(U.size(), nullptr);
  origin_of.assign(U.size(), -1);
  for (size_t i = 0; i < diff.origin.size(); ++i) {
    const Origin& o = diff.origin[i];
    origin_of[o.unit] = int(i);
    // A half named like a current unit: the Python compiler handles it. (Uids made from
    // a plan end in a digit, halves in a letter.)
    if (o.kind != Origin::kTarget && !plan) {
      std::string half(utf8(PyTuple_GET_ITEM(objs[o.a], kUid)));
      half += o.kind == Origin::kHalfA ? 'a' : 'b';
      if (uids.count(half)) diff.status = -1;
    }
  }
}

PyObject* NativeDag::unit_obj(int u) {
  if (objs[u]) return objs[u];
  PyObject* obj;
  if (u < pb.num_current) {  // from the current plan: "<stage>#<i>"
    auto [s, i] = cur_origin[u];
    const PlanStage& p = cur_plans[s];
    obj = new_unit(unit_cls.ptr(), numbered(p.stage, i), p.stage, p.model, p.trains, new_ref(p.tp),
                   new_ref(p.pp), new_ref(PyTuple_GET_ITEM(p.units, i)));
  } else {
    const Origin& o = diff.origin[origin_of[u]];
    if (o.kind == Origin::kTarget) {
      const PlanStage& p = tgt_plans[o.a];
      obj = new_unit(unit_cls.ptr(), numbered(p.stage, o.c), p.stage, p.model, p.trains,
                     new_ref(p.tp), new_ref(p.pp), new_ref(PyTuple_GET_ITEM(p.units, o.b)));
    } else {
      PyObject* base = unit_obj(o.a);
      PyObject* uid = PyUnicode_FromFormat("%U%s", PyTuple_GET_ITEM(base, kUid),
                                           o.kind == Origin::kHalfA ? "a" : "b");
      PyObject* ds = PyTuple_GET_ITEM(base, kDevices);
      Py_ssize_t n = PySequence_Size(ds), half = n / 2;
      PyObject* devs = o.kind == Origin::kHalfA ? PySequence_GetSlice(ds, 0, half)
                                                : PySequence_GetSlice(ds, half, n);
      obj = new_unit(unit_cls.ptr(), uid, PyTuple_GET_ITEM(base, kStage),
                     PyTuple_GET_ITEM(base, kModel), PyTuple_GET_ITEM(base, kTrains),
                     PyLong_FromLong(pb.units[u].tp), PyLong_FromLong(pb.units[u].pp), devs);
    }
  }
  objs[u] = obj;
  return obj;
}

py::list NativeDag::memory_units() {
  py::list out(diff.memory_order.size());
  for (size_t i = 0; i < diff.memory_order.size(); ++i)
    PyList_SET_ITEM(out.ptr(), i, new_ref(unit_obj(diff.memory_order[i])));
  return out;
}

void NativeDag::set_memory(py::list values) {
  if (values.size() != diff.memory_order.size()) throw py::value_error("one value per unit");
  mems = py::list(pb.units.size());
  for (size_t i = 0; i < diff.memory_order.size(); ++i) {
    int u = diff.memory_order[i];
    mems[u] = values[i];
    pb.units[u].mem = values[i].cast<double>();
  }
}

py::list NativeDag::layout_units() {
  std::unordered_map<uint64_t, int> group;
  layout_of.assign(pb.units.size(), -1);
  layout_rep.clear();
  for (int u : diff.memory_order) {
    const Unit& x = pb.units[u];
    uint64_t key = (uint64_t(x.model) << 42) ^ (uint64_t(x.trains) << 41) ^ (uint64_t(x.tp) << 20) ^
                   uint64_t(x.pp);
    auto [it, fresh] = group.emplace(key, int(layout_rep.size()));
    if (fresh) layout_rep.push_back(u);
    layout_of[u] = it->second;
  }
  py::list out(layout_rep.size());
  for (size_t g = 0; g < layout_rep.size(); ++g)
    PyList_SET_ITEM(out.ptr(), g, new_ref(unit_obj(layout_rep[g])));
  return out;
}

void NativeDag::set_layout_memory(py::list values) {
  if (values.size() != layout_rep.size()) throw py::value_error("one value per layout");
  mems = py::list(pb.units.size());
  std::vector<double> v(values.size());
  for (size_t g = 0; g < values.size(); ++g) v[g] = values[g].cast<double>();
  for (size_t u = 0; u < pb.units.size(); ++u) {
    PyList_SET_ITEM(mems.ptr(), u, new_ref(PyList_GET_ITEM(values.ptr(), layout_of[u])));
    pb.units[u].mem = v[layout_of[u]];
  }
}

py::tuple NativeDag::current_units() {
  py::tuple out(pb.num_current);
  for (int u = 0; u < pb.num_current; ++u) PyTuple_SET_ITEM(out.ptr(), u, new_ref(unit_obj(u)));
  return out;
}

py::tuple NativeDag::target_units() {
  py::tuple out(pb.target_units.size());
  for (size_t i = 0; i < pb.target_units.size(); ++i)
    PyTuple_SET_ITEM(out.ptr(), i, new_ref(unit_obj(pb.target_units[i])));
  return out;
}

py::list NativeDag::exist_devices() const {
  py::list out(exist.size());
  for (size_t i = 0; i < exist.size(); ++i) out[i] = devs[exist[i]];
  return out;
}

void NativeDag::run_simulation(py::object cap, double scalar, bool stage_slots) {
  pb.stage_slots = stage_slots;
  pb.exist_order = exist;
  pb.exist.assign(pb.num_devices, 0);
  pb.touched.assign(pb.num_devices, 0);
  pb.cap.assign(pb.num_devices, scalar);
  std::vector<double> caps;
  if (!cap.is_none()) {
    caps = cap.cast<std::vector<double>>();
    if (caps.size() != exist.size()) throw py::value_error("one capacity per existing device");
  }
  for (size_t i = 0; i < exist.size(); ++i) {
    pb.exist[exist[i]] = 1;
    if (!caps.empty()) pb.cap[exist[i]] = caps[i];
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

}  // namespace nereus_rl::transition
