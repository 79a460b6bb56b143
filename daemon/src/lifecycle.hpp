// Process lifecycle: systemd notification and the exit codes tandemd promises.
#pragma once

#include <string>

namespace tandem::daemon {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUnavailable = 69;  // EX_UNAVAILABLE: hardware the config demands is missing
inline constexpr int kExitConfig = 78;       // EX_CONFIG: the config is invalid; systemd must not restart

// sd_notify(state) when running under systemd ($NOTIFY_SOCKET); a no-op otherwise.
void notifySystemd(const std::string& state);

}  // namespace tandem::daemon
