// Small helpers the engine's parts share (engine.cpp, sessions.cpp, rendezvous.cpp, cluster_sync.cpp, pump.cpp).
#pragma once

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#include "tandem/common/error.hpp"
#include "tandem/v1/cluster.pb.h"

namespace tandem::daemon::detail {

using Clock = std::chrono::steady_clock;

inline std::string hexId(const std::array<uint8_t, 16>& id) {
  std::string s;
  for (int i = 0; i < 4; ++i) s += fmt::format("{:02x}", id[i]);
  return s + "…";
}

inline int32_t statusOf(ErrorCode code) { return static_cast<int32_t>(wireCode(code)); }

inline v1::PeerMessage leaveMessage(const std::array<uint8_t, 16>& uniqueId, uint32_t rank) {
  v1::PeerMessage m;
  auto* l = m.mutable_leave();
  l->set_unique_id(uniqueId.data(), uniqueId.size());
  l->set_rank(rank);
  return m;
}

// The communicator failed on this node: the others fail it too, after the collectives this node finished
// (up to completedEpoch).
inline v1::PeerMessage failMessage(const std::array<uint8_t, 16>& uniqueId, ErrorCode code, const std::string& reason,
                            uint64_t completedEpoch) {
  v1::PeerMessage m;
  auto* f = m.mutable_fail();
  f->set_unique_id(uniqueId.data(), uniqueId.size());
  f->set_code(static_cast<v1::StatusCode>(wireCode(code)));
  f->set_reason(reason);
  f->set_completed_epoch(completedEpoch);
  return m;
}

inline std::array<uint8_t, 16> uniqueIdOf(const std::string& bytes) {
  std::array<uint8_t, 16> id{};
  if (bytes.size() != id.size()) fail(ErrorCode::kProtocol, "a peer sent a communicator id of {} bytes", bytes.size());
  std::memcpy(id.data(), bytes.data(), id.size());
  return id;
}

}  // namespace tandem::daemon::detail
