// Whether an AOTInductor package of the bundle can run here (not installed): the checks the Python
// side makes (deploykit.backends.aoti.compat), against the libtorch this runtime was built with.
#pragma once

#include <string>

#include "bundle.hpp"

namespace deploykit::detail {

std::string libtorch_version();  // "2.14.1": the libtorch headers this runtime was compiled against
bool libtorch_sees_gpu(int device);
// Why `entry` cannot run here on GPU `device` (cuda packages), "" when it can.
std::string aoti_problem(const AotiEntry& entry, int device);

}  // namespace deploykit::detail
