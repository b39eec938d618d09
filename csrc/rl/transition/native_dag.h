// nereus_rl._native's transition compiler as Python sees it: one object per compile
// that holds the marshalled problem, the compiled DAGs and the Python objects the DAG's
// fields are built from (on request: nereus_rl/transition_native.py makes them lazy).
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transition/dag.h"
#include "transition/diff.h"

namespace nereus_rl::transition {

namespace py = pybind11;

// Fields of nereus_rl.transition.Unit (a NamedTuple) and of a StagePlan.
enum UnitField { kUid = 0, kStage = 1, kModel = 2, kTrains = 3, kTp = 4, kPp = 5, kDevices = 6 };

inline PyObject* new_ref(PyObject* o) {
  Py_INCREF(o);
  return o;
}

/// A tuple (or, with cls, a NamedTuple instance) that takes the references in items.
PyObject* make_tuple(PyObject* cls, std::initializer_list<PyObject*> items);

/// The UTF-8 text of a str (cached by Python in the object).
std::string_view utf8(PyObject* s);

/// Status of the front: the target uses a device that does not exist or is lost.
constexpr int kMissingDevice = 5;

/// Dense device indices: a table for small non-negative ids, a hash map otherwise.
class Devices {
 public:
  Devices(py::list* objs, std::vector<int64_t>* ids) : objs_(objs), ids_(ids) {}
  int id(PyObject* o) {
    // A device is an int: a bool or a float is a caller's mistake, not device 0/1.
    if (!PyIndex_Check(o) || PyBool_Check(o))
      throw py::type_error(std::string("a device must be an int, got ") + Py_TYPE(o)->tp_name);
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

/// A StagePlan's fields (references held by NativeDag::keep).
struct PlanStage {
  PyObject *stage, *model, *trains, *tp, *pp, *units;
};

/// One compile: the problem, the simulation, the refinements and the Python objects
/// needed to build the DAG's fields.
class NativeDag {
 public:
  NativeDag() : device_index(&devs, &dev_id) {}
  ~NativeDag() {
    for (PyObject* o : objs) Py_XDECREF(o);
  }
  NativeDag(const NativeDag&) = delete;
  NativeDag& operator=(const NativeDag&) = delete;

  Problem pb;
  Compiled c;
  std::vector<Dag> alts;
  int chosen = -1;  // -1: the simulation's DAG
  std::vector<double> dur;
  py::list devs, stages, models;  // by index: device ints, stage and model names
  py::list mems;                  // per unit: its bytes (a float object)
  py::list keep;                  // references behind the raw pointers below
  std::vector<int64_t> dev_id;    // per dense device: its id
  Devices device_index;
  DiffResult diff;
  int front_status = kOk;
  bool from_plan = false;
  py::object unit_cls;
  std::vector<PlanStage> cur_plans, tgt_plans;
  std::vector<std::pair<int, int>> cur_origin;  // from a plan: (stage plan, unit index)
  std::vector<int> origin_of;                   // per unit: its diff.origin entry or -1
  std::vector<PyObject*> objs;                  // per unit: its Unit, built on demand
  std::vector<int> exist;                       // dense devices that exist
  std::vector<int> layout_of, layout_rep;

  /// Parses the inputs, checks the devices and runs the plan diff.
  void front(py::object current, bool from_plan, py::tuple target, py::object devices,
             py::list lost, py::object unit_cls);
  /// The Unit object of unit u (borrowed; built on first use).
  PyObject* unit_obj(int u);

  int status() const {
    return front_status != kOk ? front_status : diff.status != kOk ? diff.status : c.status;
  }
  const Dag& dag() const { return chosen < 0 ? c.sim : alts[chosen]; }

  py::list memory_units();
  void set_memory(py::list values);
  py::list layout_units();
  void set_layout_memory(py::list values);
  py::tuple current_units();
  py::tuple target_units();
  py::list exist_devices() const;
  void run_simulation(py::object cap, double scalar, bool stage_slots);

  void set_durations(const std::vector<double>& d);
  void table(double es, double ebw, double rs, double rbw, double ds) {
    dur = table_costs(c, es, ebw, rs, rbw, ds);
  }
  void do_refine();
  double completion(const std::vector<double>& d) const;
  double completion_set() const { return completion(dur); }

  // The DAG's fields as Python objects.
  py::tuple primitives(py::object cls);
  py::tuple edges(py::object cls);
  py::tuple order() const;
  py::tuple funding(py::object cls);
  py::tuple anchors();
  py::tuple early() const;
  py::tuple unit_bytes();

 private:
  PyObject* dev(int d) const { return new_ref(devs[d].ptr()); }
  PyObject* unit(int u) { return new_ref(unit_obj(u)); }
  PyObject* uid(int u) { return new_ref(PyTuple_GET_ITEM(unit_obj(u), kUid)); }
  PyObject* stage(int s) const { return new_ref(stages[s].ptr()); }
  PyObject* state(int s) const;
  PyObject* slot(int key) const;
  PyObject* reason(const Edge& e);
};

}  // namespace nereus_rl::transition
