// Bindings of the copy part: one call copies a whole region table on the host.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "common.h"
#include "copy/cma.h"
#include "copy/host_copy.h"
#include "copy/net.h"
#include "copy/remap.h"

namespace py = pybind11;

namespace nereus {
namespace {

// The rows of an int64 table of `columns` columns (what: "region", "swap", "net"), after
// checking its dtype, shape and layout.
const int64_t* table_rows(const py::array& table, int columns, const char* what) {
  NEREUS_CHECK(table.dtype().is(py::dtype::of<int64_t>()),
               "the " << what << " table must be int64, got dtype "
                      << py::str(table.dtype()).cast<std::string>());
  NEREUS_CHECK(table.ndim() == 2 && table.shape(1) == columns,
               "the " << what << " table must have shape (num_rows, " << columns << "), got ndim "
                      << table.ndim());
  NEREUS_CHECK(
      table.flags() & py::array::c_style,
      "the " << what << " table must be C-contiguous; pass numpy.ascontiguousarray(table)");
  return static_cast<const int64_t*>(table.data());
}

// The region table's rows, after checking its dtype, shape and layout.
const CopyRegion* table_regions(const py::array& table) {
  return reinterpret_cast<const CopyRegion*>(table_rows(table, kCopyTableColumns, "region"));
}

int copy_regions_py(const py::array& table, int num_threads) {
  const auto* regions = table_regions(table);
  const int64_t num_regions = table.shape(0);
  py::gil_scoped_release release;
  return copy_regions(regions, num_regions, num_threads);
}

py::tuple cma_read_py(int pid, const py::array& table, int num_threads) {
  const auto* regions = table_regions(table);
  const int64_t num_regions = table.shape(0);
  CmaResult result;
  {
    py::gil_scoped_release release;
    result = cma_read(pid, regions, num_regions, num_threads);
  }
  return py::make_tuple(result.bytes, result.error);
}

py::tuple swap_pages_py(const py::array& table) {
  const auto* rows = reinterpret_cast<const SwapRow*>(table_rows(table, kSwapTableColumns, "swap"));
  for (int64_t i = 0; i < table.shape(0); ++i) {
    const SwapRow& r = rows[i];
    int64_t a_end = 0, b_end = 0;
    NEREUS_CHECK(r.nbytes >= 0 && r.a > 0 && r.b > 0 &&
                     !__builtin_add_overflow(r.a, r.nbytes, &a_end) &&
                     !__builtin_add_overflow(r.b, r.nbytes, &b_end),
                 "swap row " << i
                             << " needs two positive addresses and nbytes >= 0 whose ends "
                                "fit the address space");
    NEREUS_CHECK(r.nbytes == 0 || a_end <= r.b || b_end <= r.a,
                 "swap row " << i << " has ranges that overlap; swap disjoint ranges");
  }
  SwapResult result;
  {
    py::gil_scoped_release release;
    result = swap_pages(rows, table.shape(0));
  }
  return py::make_tuple(result.rows, result.error);
}

// A NetExchange that also holds the Python objects owning its tables' memory, so the
// memory outlives the run: the exchange's destructor cancels and joins it first.
class PyNetExchange {
 public:
  void add(int fd, bool send, const py::array& table, py::object owner) {
    const int64_t* rows = table_rows(table, kNetTableColumns, "net");
    exchange_.add(fd, send, rows, table.shape(0));
    owners_.push_back(std::move(owner));
  }
  void start() { exchange_.start(); }
  bool wait(int timeout_ms) {
    py::gil_scoped_release release;
    return exchange_.wait(timeout_ms);
  }
  void cancel() {
    py::gil_scoped_release release;
    exchange_.cancel();
  }
  py::list results() const {
    py::list out;
    for (const auto& r : exchange_.results())
      out.append(py::make_tuple(r.bytes, r.total, r.error, r.eof));
    return out;
  }

 private:
  std::vector<py::object> owners_;  // destroyed after exchange_ (declared before it)
  NetExchange exchange_;
};

}  // namespace

void register_copy(py::module_& m) {
  static_assert(sizeof(CopyRegion) == kCopyTableColumns * sizeof(int64_t), "table row layout");
  m.def("copy_regions", &copy_regions_py, py::arg("table"), py::arg("num_threads") = 0,
        R"doc(Copy every region of a table of 2-D strided host regions, GIL released.

Arguments:
    table: int64 array of shape (num_regions, 6): src_addr, dst_addr, num_rows,
        row_bytes, src_stride_bytes, dst_stride_bytes. Addresses are raw host pointers
        that the caller keeps alive for the call.
    num_threads: threads to split the bytes over (the caller counts); <= 0: one per
        CPU this process may run on. Small tables run on the caller alone.

Returns:
    The number of threads that copied.

Raises:
    ValueError: the table has the wrong dtype or shape, a negative size or stride, a
        null address, or a range whose end overflows the address space.)doc");
  m.def("cma_read", &cma_read_py, py::arg("pid"), py::arg("table"), py::arg("num_threads") = 0,
        R"doc(Read a region table from another process into this one (process_vm_readv).

Arguments:
    pid: the process whose memory the table's src addresses point into.
    table: int64 array of shape (num_regions, 6) as for copy_regions; src_addr and
        src_stride_bytes are in pid's address space, dst_* in this process's.
    num_threads: threads to split the bytes over (the caller counts); <= 0: one per
        CPU this process may run on. Small tables run on the caller alone.

Returns:
    (bytes read, errno of the first failed call or 0). EPERM/ENOSYS mean the kernel
    forbids cross-memory attach here (Yama, seccomp, credentials), ESRCH that pid is
    gone, EFAULT that a range is not mapped in pid or here.

Raises:
    ValueError: the table has the wrong dtype or shape, a negative size or stride, a
        null address, or a range whose end overflows the address space.)doc");
  static_assert(sizeof(SwapRow) == kSwapTableColumns * sizeof(int64_t), "swap row layout");
  m.def("swap_pages", &swap_pages_py, py::arg("table"),
        R"doc(Swap the pages of pairs of page-aligned ranges of this process (mremap), GIL released.

Arguments:
    table: int64 array of shape (num_rows, 3): a, b, nbytes. Both ranges of a row
        must be page-aligned, inside one private anonymous mapping each, disjoint.

Returns:
    (rows swapped, errno of the first row that failed or 0). The rows before it are
    swapped, that row and the ones after it are as they were.

Raises:
    ValueError: the table has the wrong dtype or shape, a negative size or stride, a
        null address, or a range whose end overflows the address space.)doc");
  py::class_<PyNetExchange>(m, "NetExchange", R"doc(Moves region tables over connected sockets.

Each job's rows are written to (send) or read from (receive) a non-blocking stream
socket with sendmsg/recvmsg, straight from or into the tensors' storage (rows under
4 KiB through a 64 KiB bounce buffer); the exchange's own threads (one for the sends,
one for the receives) run every job until all are done, one fails, or cancel().)doc")
      .def(py::init<>())
      .def("add", &PyNetExchange::add, py::arg("fd"), py::arg("send"), py::arg("table"),
           py::arg("owner"),
           R"doc(Add a job (before start).

Arguments:
    fd: a connected, non-blocking stream socket.
    send: write the rows (True) or read into them (False).
    table: int64 array (num_regions, 4): addr, num_rows, row_bytes, stride_bytes, raw
        host addresses validated by the caller (pack.region_table).
    owner: an object that keeps the addressed memory alive; held until the exchange
        is destroyed.)doc")
      .def("start", &PyNetExchange::start,
           "Start moving bytes: sends and receives on a thread each.")
      .def("wait", &PyNetExchange::wait, py::arg("timeout_ms"),
           "Wait up to timeout_ms, GIL released; True once the run has ended.")
      .def("cancel", &PyNetExchange::cancel, "End the run now and join its thread.")
      .def("results", &PyNetExchange::results,
           "Per job (bytes moved, total, errno or 0, peer closed early), once ended.");
  m.def("copy_default_num_threads", &copy_default_num_threads,
        "Threads copy_regions uses when num_threads <= 0 (CPUs in this process's affinity mask).");
}

}  // namespace nereus
