// Process lifecycle: systemd notification and the exit codes tandemd promises.
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace tandem::daemon {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUnavailable = 69;  // EX_UNAVAILABLE: hardware the config demands is missing
inline constexpr int kExitConfig = 78;       // EX_CONFIG: the config is invalid; systemd must not restart

// sd_notify(state) when running under systemd ($NOTIFY_SOCKET); a no-op otherwise.
void notifySystemd(const std::string& state);

// How often to send WATCHDOG=1 when the unit sets WatchdogSec= (half the interval systemd allows, as
// sd_watchdog_enabled(3) advises); nullopt when no watchdog is asked for or tandemd was built without libsystemd.
std::optional<std::chrono::microseconds> systemdWatchdogPeriod();

}  // namespace tandem::daemon
