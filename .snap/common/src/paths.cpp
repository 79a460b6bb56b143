#include "tandem/common/paths.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

std::string clientSocketPath() {
  if (const char* env = std::getenv("TANDEM_SOCKET"); env != nullptr && *env != '\0') return env;
  if (::geteuid() == 0) return kSystemSocketPath;
  return chooseClientSocket(defaultSocketPath(false), kSystemSocketPath);
}

std::string chooseClientSocket(const std::string& own, const std::string& system) {
  struct stat st{};
  if (::lstat(own.c_str(), &st) == 0) return own;
  if (::lstat(system.c_str(), &st) == 0 || errno == EACCES) return system;
  return own;
}

}  // namespace tandem
