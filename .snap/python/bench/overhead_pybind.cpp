// The floor of a compiled-extension binding, for the per-call overhead comparison (overhead.py): one pybind11
// call that passes a prepacked argument struct to libtandem (and waits on the cpu backend), like the ctypes floor.
// Not part of the package: it exists only to decide ctypes versus extension by measurement.
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "tandem/tandem.h"

namespace {
using OpFn = tandem_status_t (*)(void*, const void*, tandem_op_t*);
using WaitFn = tandem_status_t (*)(tandem_op_t, int64_t);
OpFn gemmAr = nullptr, barrierStream = nullptr;
WaitFn waitOp = nullptr;
tandem_op_t lastOp{};

void setup(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) throw std::runtime_error(dlerror());
  gemmAr = reinterpret_cast<OpFn>(dlsym(h, "tandem_gemm_ar"));
  barrierStream = reinterpret_cast<OpFn>(dlsym(h, "tandem_barrier_stream"));
  waitOp = reinterpret_cast<WaitFn>(dlsym(h, "tandem_wait"));
}

int call(OpFn fn, uintptr_t comm, uintptr_t args, bool cuda) {
  pybind11::gil_scoped_release release;  // as ctypes does: a wait may block
  tandem_status_t s = fn(reinterpret_cast<void*>(comm), reinterpret_cast<const void*>(args), &lastOp);
  if (s == TANDEM_SUCCESS && !cuda) s = waitOp(lastOp, -1);
  return s;
}
}  // namespace

PYBIND11_MODULE(tandem_overhead_pybind, m) {
  m.def("setup", &setup);
  m.def("gemm_ar", [](uintptr_t c, uintptr_t a, bool cuda) { return call(gemmAr, c, a, cuda); });
  m.def("barrier", [](uintptr_t c, uintptr_t a, bool cuda) { return call(barrierStream, c, a, cuda); });
}
