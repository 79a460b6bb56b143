// The wire protocol's version: one definition for tandemd and libtandem. tandem.h repeats it for programs as
// TANDEM_PROTOCOL_VERSION (a C header cannot include this one); c_api.cpp checks that the two agree.
#pragma once

#include <cstdint>

namespace tandem {

// Bumped when the protocol between libtandem and tandemd changes incompatibly (Hello refuses other versions).
// 3: a completion's message longer than one record continues in the records after it (descriptor.hpp).
inline constexpr uint32_t kProtocolVersion = 3;

}  // namespace tandem
