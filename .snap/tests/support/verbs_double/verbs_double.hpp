// Test-side access to the verbs test double's own API (verbs_double_control.h). The double is loaded in place of
// libibverbs through LD_LIBRARY_PATH, so its functions are found with dlsym: present means the double is loaded.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace tandem::testing::verbs_double {

/// Whether this process runs on the double (and not on rdma-core).
inline bool loaded() { return ::dlsym(RTLD_DEFAULT, "tandem_verbs_double_counter") != nullptr; }

/// Why the double is not loaded, for a test's failure message.
inline std::string notLoadedReason() {
  return "the verbs test double is not loaded: run this test through ctest (its ENVIRONMENT puts the double's "
         "directory first in LD_LIBRARY_PATH), or set LD_LIBRARY_PATH=<build>/verbs-double";
}

template <typename Fn>
Fn* symbol(const char* name) {
  void* f = ::dlsym(RTLD_DEFAULT, name);
  if (f == nullptr) throw std::runtime_error(notLoadedReason());
  return reinterpret_cast<Fn*>(f);
}

/// tandem_verbs_double_set_faults: throws on a spec the double refuses.
inline void setFaults(const std::string& spec) {
  if (symbol<int(const char*)>("tandem_verbs_double_set_faults")(spec.c_str()) != 0)
    throw std::runtime_error("verbs double refused the fault spec '" + spec + "'");
}

inline void vanish() { symbol<void()>("tandem_verbs_double_vanish")(); }

inline uint64_t counter(const std::string& name) {
  return symbol<uint64_t(const char*)>("tandem_verbs_double_counter")(name.c_str());
}

}  // namespace tandem::testing::verbs_double
