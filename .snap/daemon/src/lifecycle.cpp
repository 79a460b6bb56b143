#include "lifecycle.hpp"

#ifdef TANDEM_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace tandem::daemon {

void notifySystemd(const std::string& state) {
#ifdef TANDEM_HAVE_SYSTEMD
  sd_notify(0, state.c_str());
#else
  (void)state;  // built without libsystemd: Type=notify units need it (TANDEM_WITH_SYSTEMD)
#endif
}

std::optional<std::chrono::microseconds> systemdWatchdogPeriod() {
#ifdef TANDEM_HAVE_SYSTEMD
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) return std::chrono::microseconds(usec / 2);
#endif
  return std::nullopt;
}

}  // namespace tandem::daemon
