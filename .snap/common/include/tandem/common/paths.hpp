#pragma once

#include <string>

namespace tandem {

// Where tandemd listens unless told otherwise: $TANDEM_SOCKET if set; else /run/tandem/tandemd.sock as root;
// else $XDG_RUNTIME_DIR/tandem/tandemd.sock; else /tmp/tandem-<uid>/tandemd.sock.
// The daemon ignores $TANDEM_SOCKET (it takes --socket or daemon.socket); clients and tandemctl honour it.
std::string defaultSocketPath(bool honourEnv);

// Where a client (libtandem's tandem_connect(NULL), tandemctl) looks: $TANDEM_SOCKET if set; as root
// /run/tandem/tandemd.sock; else the per-user socket (defaultSocketPath) when it exists, and otherwise the system
// daemon's /run/tandem/tandemd.sock when that exists (or cannot be inspected because /run/tandem is closed to this user,
// so that connecting says which group to join); else the per-user path, for the error to name.
std::string clientSocketPath();
// The choice clientSocketPath() makes between the per-user socket `own` and the system one: `own` if it exists, else
// `system` if it exists or this user may not look (EACCES), else `own`.
std::string chooseClientSocket(const std::string& own, const std::string& system);

// The system daemon's socket (tandemd.socket, and tandemd run as root).
inline constexpr const char* kSystemSocketPath = "/run/tandem/tandemd.sock";

}  // namespace tandem
