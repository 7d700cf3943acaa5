// Registration: the Python extension module `oneccl_bind_pt._C`.
// The Python package registers the backend with torch.distributed on import.
#include "errors.hpp"
#include "helpers.hpp"
#include "made_once.hpp"
#include "kernels.hpp"
#include "process_group_ccl.hpp"
#include "raw.hpp"
#include "rendezvous.hpp"
#include "work.hpp"

#include <pybind11/chrono.h>
#include <pthread.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace {

// How long a process's exit waits for abort hooks still running (a trace
// being written: torch 2.15's FlightRecorderHook took up to 9 s here).
constexpr std::chrono::milliseconds kExitHookWait{15000};

// The package's function that sets its oneCCL defaults before the process's first group
// (oneccl_bind_pt/__init__.py), set once at import; every construction calls it, so that a
// group built directly, as torch-ccl's users did, gets what init_process_group's does.
PyObject* g_before_group = nullptr;

// oneccl_bind_pt.errors' classes, set once by the package's __init__.
PyObject* g_argument_error = nullptr;
PyObject* g_argument_type_error = nullptr;

// Our argument errors reach Python as oneccl_bind_pt.errors' classes. pybind11
// tries the translators registered last first, so this runs before torch's,
// which would make them plain DistBackendErrors.
void register_error_types(py::object value_error, py::object type_error) {
  g_argument_error = value_error.release().ptr();
  g_argument_type_error = type_error.release().ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) {
        std::rethrow_exception(p);
      }
    } catch (const oneccl_bind_pt::ArgumentError& e) {
      PyErr_SetString(g_argument_error, e.what_without_backtrace());
    } catch (const oneccl_bind_pt::ArgumentTypeError& e) {
      PyErr_SetString(g_argument_type_error, e.what_without_backtrace());
    }
  });
}

// A child forked after the parent made its threads (progress, callbacks, helpers) makes its
// own at first use, so that its exit does not wait on a lock that a thread it does not have
// held at the fork (measured: a forked child hung for good in Progress::shutdown at its exit).
// The parent's groups refuse it (Communicator::inherited).
void forget_process_state_in_child() {
  oneccl_bind_pt::g_forks.fetch_add(1, std::memory_order_relaxed);
  oneccl_bind_pt::Progress::forget_in_child();
  oneccl_bind_pt::Callbacks::forget_in_child();
  oneccl_bind_pt::forget_exit_waits_in_child();
  oneccl_bind_pt::forget_helpers_in_child();
}

std::string runtime_ccl_version() {
  const auto v = ccl::get_library_version();
  return v.full ? std::string(v.full) : std::to_string(v.major) + "." + std::to_string(v.minor);
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "oneCCL backend for torch.distributed (internal; use `import oneccl_bind_pt`).";

  // The base class must be known to pybind11 before we derive from it.
  py::module::import("torch.distributed");
  pthread_atfork(nullptr, nullptr, forget_process_state_in_child);

  py::class_<
      oneccl_bind_pt::ProcessGroupCCL,
      c10d::Backend,
      c10::intrusive_ptr<oneccl_bind_pt::ProcessGroupCCL>>(m, "ProcessGroupCCL")
      .def(
          py::init([](const c10::intrusive_ptr<c10d::Store>& store,
                      int rank,
                      int size,
                      std::chrono::milliseconds timeout) {
            // This creation's keys, taken once: the defaults' exchanges and the group's own
            // use the same ones (a retry on the same store gets fresh keys for both).
            c10::intrusive_ptr<c10d::Store> keys;
            {
              py::gil_scoped_release released;
              keys = oneccl_bind_pt::creation_keys(store, rank);
              oneccl_bind_pt::ProcessGroupCCL::check_own_settings(keys, rank, size);
            }
            if (g_before_group) {
              py::reinterpret_borrow<py::object>(g_before_group)(keys, rank, size, timeout);
            }
            py::gil_scoped_release released;
            return c10::make_intrusive<oneccl_bind_pt::ProcessGroupCCL>(keys, rank, size, timeout, /*numbered=*/true);
          }),
          py::arg("store"),
          py::arg("rank"),
          py::arg("size"),
          py::arg("timeout") = std::chrono::milliseconds(kBackendDefaultTimeout))
      .def(
          "_path",
          &oneccl_bind_pt::ProcessGroupCCL::path,
          py::arg("kind"),
          py::arg("nbytes"),
          "'shm', 'cma' or 'oneccl': how a collective of this kind and size per rank moves "
          "(staged through shared memory, read from the peers' tensors, or through oneCCL).")
      .def(
          "_single_copy",
          &oneccl_bind_pt::ProcessGroupCCL::single_copy_status,
          "'on' when this group's ranks may read each other's tensors (single copy), else "
          "'off: <why>'.")
      .def(
          "_staging_chunk",
          &oneccl_bind_pt::ProcessGroupCCL::staging_chunk,
          "How much a staged step of a large collective moves per rank on this group, and why "
          "(the smallest of its ranks' choices).");

  m.def(
      "_set_before_group",
      [](py::object fn) { g_before_group = fn.release().ptr(); }, // kept for the process's life
      py::arg("fn"),
      "Sets what every ProcessGroupCCL construction calls first, fn(store, rank, size, timeout) "
      "(the package's oneCCL defaults, once per process).");
  m.def(
      "_shutdown",
      [] {
        oneccl_bind_pt::settle_aborts(kExitHookWait);
        oneccl_bind_pt::wait_for_abort_hooks(kExitHookWait);
        oneccl_bind_pt::Progress::get().shutdown();
        oneccl_bind_pt::unlink_own_fabric_segments();
      },
      py::call_guard<py::gil_scoped_release>(),
      "Waits for abort() calls and abort hooks still running (at most 15 s each), stops the "
      "background progress thread "
      "and unlinks libfabric's segments of this process (called at interpreter exit).");
  m.def(
      "_child_exit",
      [] {
        oneccl_bind_pt::wait_for_abort_hooks(kExitHookWait);
        oneccl_bind_pt::unlink_own_fabric_segments();
      },
      py::call_guard<py::gil_scoped_release>(),
      "Waits for abort hooks still running (at most 15 s) and unlinks libfabric's /dev/shm "
      "segments of this process (at a multiprocessing child's exit).");
  m.def(
      "_announce_failure",
      [](const c10::intrusive_ptr<c10d::Store>& keys, int rank, const std::string& why) {
        oneccl_bind_pt::announce_failure(keys, rank, why); // (it swallows a store's own failure)
      },
      py::arg("keys"),
      py::arg("rank"),
      py::arg("why"),
      py::call_guard<py::gil_scoped_release>(),
      "Tells the other ranks creating a group that this rank cannot, and why, through `keys`, the "
      "creation's keys ProcessGroupCCL's construction hands the package's defaults: they raise at "
      "once instead of waiting out the group's timeout.");
  m.def(
      "_time_raw_oneccl",
      &oneccl_bind_pt::time_raw_oneccl,
      py::arg("pg"),
      py::arg("op"),
      py::arg("input"),
      py::arg("output"),
      py::arg("iters"),
      py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "Per-call seconds of oneCCL alone on pg's communicator (the benchmark's baseline); a call not "
      "complete within `timeout` aborts the group and raises DistBackendError.");
  m.def(
      "_register_error_types",
      &register_error_types,
      py::arg("value_error"),
      py::arg("type_error"),
      "Maps the backend's argument errors to these Python classes (called once on import).");
  m.def(
      "kernels",
      [] { return oneccl_bind_pt::kernels().description; },
      "The shared-memory transport's reduce kernels and copy, and why they were chosen.");
  m.def(
      "helpers",
      [] { return oneccl_bind_pt::helper_plan().description; },
      "How many helper threads split this process's large copies and reductions, and why.");
  m.def(
      "_idle_share",
      &oneccl_bind_pt::idle_share,
      py::arg("allowed"),
      py::arg("running"),
      py::arg("awake"),
      py::arg("local"),
      py::arg("most"),
      "The idle helpers a split may use with `running` runnable threads on the host, `awake` of them "
      "this rank's helpers, on `allowed` CPUs shared by `local` ranks, at most `most`.");
  m.def("_runnable_threads", &oneccl_bind_pt::runnable_threads, "The host's runnable threads now (-1: unknown).");
  m.def(
      "_allow_idle_helpers",
      &oneccl_bind_pt::allow_idle_helpers,
      py::arg("allowed"),
      "Whether large copies and reductions may take idle helpers from now on (the plan's, "
      "ONECCL_BIND_PT_IDLE_HELPERS); returns the previous setting. For benchmarks that compare.");
  m.def(
      "_split_counts",
      [] { return oneccl_bind_pt::split_counts(); },
      "(splits run on helpers, of them those that used idle helpers) in this process so far.");
  m.def(
      "rank_cores",
      [](int local_ranks) {
        const auto r = oneccl_bind_pt::rank_cores(local_ranks);
        return py::make_tuple(r.cores, r.pinned, r.why, r.crowded);
      },
      py::arg("local_ranks"),
      "(cores, pinned, why, crowded): the cores this rank has with `local_ranks` ranks on its host, "
      "and whether those ranks outnumber the CPUs they share.");
  m.def("ccl_runtime_version", &runtime_ccl_version, "oneCCL version loaded at run time.");
  m.attr("ccl_build_version") = std::to_string(CCL_MAJOR_VERSION) + "." +
      std::to_string(CCL_MINOR_VERSION) + "." + std::to_string(CCL_UPDATE_VERSION);
}
