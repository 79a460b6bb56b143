#include "tandem/common/paths.hpp"

#include <unistd.h>

#include <cstdlib>

#include <fmt/format.h>

namespace tandem {

std::string defaultSocketPath(bool honourEnv) {
  if (honourEnv) {
    if (const char* env = std::getenv("TANDEM_SOCKET"); env != nullptr && *env != '\0') return env;
  }
  if (::geteuid() == 0) return "/run/tandem/tandemd.sock";
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return std::string(xdg) + "/tandem/tandemd.sock";
  }
  return fmt::format("/tmp/tandem-{}/tandemd.sock", ::geteuid());
}

}  // namespace tandem
