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

}  // namespace tandem::daemon
