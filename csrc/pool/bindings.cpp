// Bindings of the communicator pool's decision core (nereus_comm._C.PoolCore).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "pool/pool_core.h"

namespace py = pybind11;

namespace nereus {

void register_pool(py::module_& m) {
  py::enum_<PoolAction>(m, "PoolAction")
      .value("HIT", PoolAction::kHit)
      .value("SPLIT", PoolAction::kSplit)
      .value("SHRINK", PoolAction::kShrink)
      .value("GROW", PoolAction::kGrow)
      .value("INIT", PoolAction::kInit);

  py::class_<PoolDecision>(m, "PoolDecision")
      .def_property_readonly("action_name",
                             [](const PoolDecision& d) { return pool_action_name(d.action); })
      .def_readonly("action", &PoolDecision::action)
      .def_readonly("key", &PoolDecision::key)
      .def_readonly("parent", &PoolDecision::parent)
      .def_readonly("parent_handle", &PoolDecision::parent_handle)
      .def_readonly("handle", &PoolDecision::handle)
      .def("__repr__", [](const PoolDecision& d) {
        return "PoolDecision(" + std::string(pool_action_name(d.action)) +
               ", key=" + py::repr(py::cast(d.key)).cast<std::string>() +
               ", parent=" + py::repr(py::cast(d.parent)).cast<std::string>() + ")";
      });

  py::class_<PoolDisposal>(m, "PoolDisposal")
      .def_readonly("key", &PoolDisposal::key)
      .def_readonly("handle", &PoolDisposal::handle)
      .def_readonly("broken", &PoolDisposal::broken);

  py::class_<PoolCounters>(m, "PoolCounters")
      .def_readonly("hits", &PoolCounters::hits)
      .def_readonly("misses", &PoolCounters::misses)
      .def_readonly("splits", &PoolCounters::splits)
      .def_readonly("shrinks", &PoolCounters::shrinks)
      .def_readonly("grows", &PoolCounters::grows)
      .def_readonly("inits", &PoolCounters::inits)
      .def_readonly("evictions", &PoolCounters::evictions)
      .def_readonly("failures", &PoolCounters::failures)
      .def_readonly("create_seconds", &PoolCounters::create_seconds);

  py::class_<PoolCore>(m, "PoolCore",
                       "Decision core of the communicator pool: keys are ordered rank tuples.")
      .def(py::init<int64_t, bool, bool, bool>(), py::arg("capacity"), py::arg("can_split"),
           py::arg("can_shrink"), py::arg("can_grow"))
      .def("acquire", &PoolCore::acquire, py::arg("ranks"))
      .def("commit", &PoolCore::commit, py::arg("ranks"), py::arg("handle"), py::arg("seconds"))
      .def("abort", &PoolCore::abort, py::arg("ranks"))
      .def("release", &PoolCore::release, py::arg("ranks"))
      .def("mark_lost", &PoolCore::mark_lost, py::arg("dead"))
      .def("clear", &PoolCore::clear)
      .def("counters", &PoolCore::counters)
      .def("lru_order", &PoolCore::lru_order)
      .def("pins", &PoolCore::pins, py::arg("ranks"))
      .def("is_broken", &PoolCore::is_broken, py::arg("ranks"))
      .def("dead_ranks", &PoolCore::dead_ranks)
      .def_property_readonly("capacity", &PoolCore::capacity)
      .def_property_readonly("size", &PoolCore::size);
}

}  // namespace nereus
