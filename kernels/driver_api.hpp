// Forwards to the one driver file, tandem/kernels/driver.hpp. Kept only while units written before it (attention.cu,
// grouped_gemm.cpp) still include this name; include tandem/kernels/driver.hpp instead.
#pragma once

#include "tandem/kernels/driver.hpp"
