// python/csrc/accounting_bindings.cpp — accountants, calibration and the ledger (accounting/).
// std::invalid_argument surfaces as ValueError, std::runtime_error as RuntimeError.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "accounting/banded.h"
#include "accounting/calibrate.h"
#include "accounting/ledger.h"
#include "accounting/prv.h"
#include "accounting/rdp.h"
#include "accounting/types.h"
#include "python/csrc/bindings.h"

namespace py = pybind11;

namespace dpzero::python {
namespace {

// A double as Python's repr writes it (the shortest string that reads back the same value).
std::string float_repr(double v) { return py::repr(py::float_(v)).cast<std::string>(); }

using namespace dpzero::accounting;

void bind_accountants(py::module_& m) {
  py::class_<Phase>(m, "Phase")
      .def(py::init([](double q, double sigma, int64_t steps) { return Phase{q, sigma, steps}; }),
           py::arg("q"), py::arg("sigma"), py::arg("steps"))
      .def_readwrite("q", &Phase::q)
      .def_readwrite("sigma", &Phase::sigma)
      .def_readwrite("steps", &Phase::steps)
      .def("__repr__", [](const Phase& p) {
        return "Phase(q=" + std::to_string(p.q) + ", sigma=" + std::to_string(p.sigma) +
               ", steps=" + std::to_string(p.steps) + ")";
      });

  m.def("banded_equivalent_steps", &banded_equivalent_steps, py::arg("rows"), py::arg("bands"),
        "The DP-SGD steps a banded run over `rows` steps equals (Note [amplified banded "
        "accounting] in accounting/banded.h)");
  m.def("equivalent_steps", &equivalent_steps, py::arg("charges"), py::arg("rows"),
        py::arg("bands"),
        "The DP-SGD steps a run has spent: its charges at bands=1, the banded equivalent steps of "
        "its rows otherwise (accounting/banded.h)");
  m.def("opacus_default_orders", &opacus_default_orders);
  m.def("tfp_default_orders", &tfp_default_orders);
  m.def("compute_log_a", &compute_log_a, py::arg("q"), py::arg("sigma"), py::arg("alpha"),
        "log A_alpha of one step of the Poisson-subsampled Gaussian (Mironov et al. 2019).");
  m.def("compute_rdp", &compute_rdp, py::arg("q"), py::arg("sigma"), py::arg("steps"),
        py::arg("orders"));

  py::class_<RdpEpsilon>(m, "RdpEpsilon")
      .def_readonly("epsilon", &RdpEpsilon::epsilon)
      .def_readonly("best_order", &RdpEpsilon::best_order)
      .def_readonly("order_on_edge", &RdpEpsilon::order_on_edge)
      .def("__repr__", [](const RdpEpsilon& e) {
        return "RdpEpsilon(epsilon=" + float_repr(e.epsilon) + ", best_order=" +
               float_repr(e.best_order) + ", order_on_edge=" +
               std::string(e.order_on_edge ? "True" : "False") + ")";
      });
  m.def("rdp_to_epsilon", &rdp_to_epsilon, py::arg("orders"), py::arg("rdp"), py::arg("delta"));

  // Held by shared_ptr: a private step composes the charges into the very accountant Python
  // reads (dpzero._C.dp.PrivateStep's accountant).
  py::class_<Accountant, std::shared_ptr<Accountant>>(
      m, "Accountant", "The phases of a run, merged, which an accountant composes")
      .def("add", &Accountant::add, py::arg("phase"))
      .def("step", &Accountant::step, py::arg("q"), py::arg("sigma"), py::arg("steps") = 1)
      .def_property_readonly("kind",
                             [](const Accountant& a) { return to_string(a.kind()); })
      .def_property_readonly("phases", &Accountant::phases)
      .def_property_readonly("steps", &Accountant::steps);

  py::class_<RdpAccountant, Accountant, std::shared_ptr<RdpAccountant>>(m, "RdpAccountant")
      .def(py::init([](std::optional<std::vector<double>> orders) {
             return std::make_shared<RdpAccountant>(orders ? RdpAccountant(*orders)
                                                           : RdpAccountant());
           }),
           py::arg("orders") = py::none())
      .def("epsilon", &RdpAccountant::epsilon, py::arg("delta"))
      .def("delta", &RdpAccountant::delta, py::arg("epsilon"))
      .def_property_readonly("orders", &RdpAccountant::orders);

  py::class_<PrvEpsilon>(m, "PrvEpsilon")
      .def_readonly("lower", &PrvEpsilon::lower)
      .def_readonly("estimate", &PrvEpsilon::estimate)
      .def_readonly("upper", &PrvEpsilon::upper)
      .def("__repr__", [](const PrvEpsilon& b) {
        return "PrvEpsilon(lower=" + float_repr(b.lower) + ", estimate=" + float_repr(b.estimate) +
               ", upper=" + float_repr(b.upper) + ")";
      });
  py::class_<PrvDelta>(m, "PrvDelta")
      .def_readonly("lower", &PrvDelta::lower)
      .def_readonly("estimate", &PrvDelta::estimate)
      .def_readonly("upper", &PrvDelta::upper)
      .def("__repr__", [](const PrvDelta& b) {
        return "PrvDelta(lower=" + float_repr(b.lower) + ", estimate=" + float_repr(b.estimate) +
               ", upper=" + float_repr(b.upper) + ")";
      });
  py::class_<PrvAccountant, Accountant, std::shared_ptr<PrvAccountant>>(m, "PrvAccountant")
      .def(py::init([] { return std::make_shared<PrvAccountant>(); }))
      .def(
          "epsilon",
          [](const PrvAccountant& a, double delta, double eps_error, double delta_error) {
            return a.epsilon(delta, PrvOptions{eps_error, delta_error});
          },
          py::arg("delta"), py::arg("eps_error") = 0.01, py::arg("delta_error") = 0.0,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "delta",
          [](const PrvAccountant& a, double epsilon, double eps_error, double delta_error) {
            return a.delta(epsilon, PrvOptions{eps_error, delta_error});
          },
          py::arg("epsilon"), py::arg("eps_error") = 0.01, py::arg("delta_error") = 0.0,
          py::call_guard<py::gil_scoped_release>());
}

CalibrationOptions calibration_options(const std::string& accountant, double epsilon_tolerance,
                                       double eps_error, double delta_error) {
  CalibrationOptions options;
  options.accountant = parse_accountant_kind(accountant);
  options.epsilon_tolerance = epsilon_tolerance;
  options.prv = PrvOptions{eps_error, delta_error};
  return options;
}

void bind_calibration(py::module_& m) {
  m.def(
      "noise_multiplier_for_epsilon",
      [](double target_epsilon, double delta, double q, int64_t steps, const std::string& accountant,
         double epsilon_tolerance, double eps_error, double delta_error) {
        return noise_multiplier_for_epsilon(
            target_epsilon, delta, q, steps,
            calibration_options(accountant, epsilon_tolerance, eps_error, delta_error));
      },
      py::arg("target_epsilon"), py::arg("delta"), py::arg("q"), py::arg("steps"),
      py::arg("accountant") = "rdp", py::arg("epsilon_tolerance") = 0.01,
      py::arg("eps_error") = 0.01, py::arg("delta_error") = 0.0,
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "steps_for_epsilon",
      [](double target_epsilon, double delta, double q, double sigma, const std::string& accountant,
         double eps_error, double delta_error) {
        return steps_for_epsilon(target_epsilon, delta, q, sigma,
                                 calibration_options(accountant, 0.01, eps_error, delta_error));
      },
      py::arg("target_epsilon"), py::arg("delta"), py::arg("q"), py::arg("sigma"),
      py::arg("accountant") = "rdp", py::arg("eps_error") = 0.01, py::arg("delta_error") = 0.0,
      py::call_guard<py::gil_scoped_release>());
}

void bind_ledger(py::module_& m) {
  py::register_exception<LedgerError>(m, "LedgerError", PyExc_RuntimeError);

  py::class_<LedgerRecord>(m, "LedgerRecord")
      .def(py::init<>())
      .def_readwrite("first_step", &LedgerRecord::first_step)
      .def_readwrite("last_step", &LedgerRecord::last_step)
      .def_readwrite("q", &LedgerRecord::q)
      .def_readwrite("sigma", &LedgerRecord::sigma)
      .def_readwrite("max_grad_norm", &LedgerRecord::max_grad_norm)
      .def_readwrite("noise", &LedgerRecord::noise)
      .def_readwrite("sampling", &LedgerRecord::sampling)
      .def_property_readonly("steps", &LedgerRecord::steps);

  // Ledger is move-only: Python holds it through a shared_ptr, which a private step
  // (src/dp/private_step.h) shares.
  py::class_<Ledger, std::shared_ptr<Ledger>>(m, "Ledger")
      .def_static(
          "create",
          [](const std::string& path, const std::string& run_id, int64_t dataset_size,
             const std::string& settings_json) {
            LedgerHeader header;
            header.run_id = run_id;
            header.dataset_size = dataset_size;
            try {
              header.settings = nlohmann::ordered_json::parse(settings_json);
            } catch (const nlohmann::json::exception& e) {
              throw std::invalid_argument("ledger settings must be a JSON object, got '" +
                                          settings_json + "' (" + e.what() + ")");
            }
            return std::make_shared<Ledger>(Ledger::create(path, header));
          },
          py::arg("path"), py::arg("run_id"), py::arg("dataset_size"),
          py::arg("settings_json") = "{}")
      .def_static(
          "open",
          [](const std::string& path, bool truncate_torn_tail, const std::string& expected_run_id) {
            return std::make_shared<Ledger>(Ledger::open(
                path, truncate_torn_tail ? TornTailPolicy::kTruncate : TornTailPolicy::kError,
                expected_run_id));
          },
          py::arg("path"), py::arg("truncate_torn_tail") = false, py::arg("expected_run_id") = "")
      .def_static(
          "open_read_only",
          [](const std::string& path, const std::string& expected_run_id) {
            return std::make_shared<Ledger>(Ledger::open_read_only(path, expected_run_id));
          },
          py::arg("path"), py::arg("expected_run_id") = "")
      .def("append", &Ledger::append, py::arg("record"), py::call_guard<py::gil_scoped_release>())
      .def("close", &Ledger::close, "Release the file and the writer lock; append() then raises")
      .def_property_readonly("path", &Ledger::path)
      .def_property_readonly("run_id", [](const Ledger& l) { return l.header().run_id; })
      .def_property_readonly("dataset_size", [](const Ledger& l) { return l.header().dataset_size; })
      .def_property_readonly("format", [](const Ledger& l) { return l.header().format; })
      .def_property_readonly("settings_json", [](const Ledger& l) { return l.header().settings.dump(); })
      .def_property_readonly("records", &Ledger::records)
      .def_property_readonly("total_steps", &Ledger::total_steps)
      .def_property_readonly("unnoised_steps", &Ledger::unnoised_steps)
      .def("phases", &Ledger::phases)
      .def_property_readonly("rows", &Ledger::rows)
      .def_property_readonly("bands", [](const Ledger& l) { return header_bands(l.header()); })
      .def_property_readonly("torn_tail", [](const Ledger& l) { return py::bytes(l.torn_tail()); })
      .def_property_readonly("torn_tail_line", &Ledger::torn_tail_line);
}

}  // namespace

void bind_accounting(py::module_ m) {
  bind_accountants(m);
  bind_calibration(m);
  bind_ledger(m);
}

}  // namespace dpzero::python
