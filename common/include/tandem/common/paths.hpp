#pragma once

#include <string>

namespace tandem {

// Where tandemd listens unless told otherwise: $TANDEM_SOCKET if set; else /run/tandem/tandemd.sock as root;
// else $XDG_RUNTIME_DIR/tandem/tandemd.sock; else /tmp/tandem-<uid>/tandemd.sock.
// The daemon ignores $TANDEM_SOCKET (it takes --socket or daemon.socket); clients and tandemctl honour it.
std::string defaultSocketPath(bool honourEnv);

}  // namespace tandem
