// python/csrc/dp_bindings.cpp — dpzero._C.dp: the private step's C++ core (src/dp), as the Python
// book calls it. Issue 23 moves the book there piece by piece; each piece is bound here.
#include <vector>

#include <pybind11/stl.h>
#include <torch/extension.h>

#include "python/csrc/bindings.h"
#include "src/dp/clip_group.h"

namespace py = pybind11;

namespace dpzero::python {

void bind_dp(py::module_ m) {
  m.def("group_norms", &dp::group_norms, py::arg("components"),
        "Certified [B] float32 norms of one clipping group from its components' parts' [B] "
        "float32 certified squared norms (Note [certified group norms] in src/dp/clip_group.h)");
  m.def("mean_scaled_sq", &dp::mean_scaled_sq, py::arg("sq"), py::arg("b"),
        "Squared norms of G as delivered -> of the per-sample gradients of a mean loss over b "
        "rows: sq * b^2 rounded up to float32 (Note [mean loss])");
  m.def("mean_scaled_factors", &dp::mean_scaled_factors, py::arg("factors"), py::arg("b"),
        "Clip factors of the per-sample gradients -> of G as delivered under a mean loss over b "
        "rows: c * b rounded toward zero (Note [mean loss])");
  m.def("certified_sum", &dp::certified_sum, py::arg("sqs"),
        "[B] float32 never below the exact sum of 1 to 8 [B] float32 certified squared norms");
  m.def("round_up_f32", &dp::round_up_f32, py::arg("x"),
        "float64 -> float32 rounded toward +inf (NaN and Inf unchanged)");
  m.def("round_down_f32", &dp::round_down_f32, py::arg("x"),
        "float64 >= 0 -> float32 rounded toward 0");
}

}  // namespace dpzero::python
