// The tcp transport's framing: what travels on a connection after the handshake (see tcp_transport.hpp for what
// the frames mean and how they are ordered).
//
// Every frame is a 32-byte little-endian header {type, reserved (0), region id, offset, length, value} followed by
// `length` payload bytes:
//   data       region id and offset name the destination in the receiver's region; the payload is the bytes
//   flag       the 8-byte-aligned destination and the value to store; payload: the sender's per-connection counts
//              of data frames queued before it (u64 each)
//   message    region id and offset 0, value = message bytes; payload: the counts (as a flag), then the message
//   heartbeat  no payload; keeps an idle connection's deadline from firing
//   goodbye    the sender shuts down; the receiver marks it closed
//
// Everything here is pure (no sockets), unit-tested in tcp_logic_test.cpp.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "transport/transport.hpp"

namespace tandem::daemon::transport::tcp {

static_assert(std::endian::native == std::endian::little,
              "the tcp frame header is sent as a little-endian struct; add byte swaps for big-endian hosts");

enum class FrameType : uint8_t { kData = 1, kFlag = 2, kHeartbeat = 3, kGoodbye = 4, kMessage = 5 };

struct FrameHeader {
  uint8_t type = 0;
  uint8_t reserved[3] = {0, 0, 0};
  uint32_t regionId = 0;  ///< the key: the receiver's LocalRegion id
  uint64_t offset = 0;
  uint64_t length = 0;    ///< payload bytes that follow
  uint64_t value = 0;     ///< flag value; message: message payload bytes (length - data counts)
};
static_assert(sizeof(FrameHeader) == 32 && std::is_trivially_copyable_v<FrameHeader>);

inline constexpr uint64_t kMaxFramePayload = uint64_t{64} << 20;  ///< receivers refuse larger data frames
inline constexpr std::size_t kMaxBatchFrames = 256;                ///< frames per async_write (keeps heartbeats timely)
inline constexpr uint64_t kMaxBatchBytes = uint64_t{8} << 20;      ///< bytes per async_write, likewise

/// Bytes of the per-connection counts a flag or message carries.
constexpr uint64_t countsBytes(uint32_t connections) { return uint64_t{connections} * sizeof(uint64_t); }

FrameHeader dataHeader(uint32_t regionId, uint64_t offset, uint64_t bytes);
/// `connections`: the sender's connections per peer, whose counts the payload carries.
FrameHeader flagHeader(uint32_t regionId, uint64_t offset, uint64_t value, uint32_t connections);
FrameHeader messageHeader(uint64_t messageBytes, uint32_t connections);
FrameHeader heartbeatHeader();
FrameHeader goodbyeHeader();

/// A flag's payload: the counts, little-endian. A message's: the counts, then the message bytes.
std::vector<std::byte> countsPayload(std::span<const uint64_t> counts, std::span<const std::byte> message = {});

/// One data frame of a write.
struct Chunk {
  uint32_t connection = 0;
  uint64_t offset = 0;  ///< in the destination region
  uint64_t bytes = 0;
};
/// The next data frame of a write whose remaining part starts at `offset` of region `regionId`. Frames are cut at
/// multiples of chunkBytes in the destination region, and destination chunk i of region r always travels on
/// connection (r + i) % connections: large writes spread over every connection, yet two writes to the same bytes
/// share a connection and land in the order issued (write-after-write order, as on one RC QP).
Chunk nextChunk(uint32_t regionId, uint64_t offset, uint64_t remaining, uint64_t chunkBytes, uint32_t connections);

/// Checks a received header before anything else is read: reserved bytes, and per type the length rules (a
/// message also its connection, region, offset and size limit). Returns what is wrong (the text after "sent a
/// malformed frame on connection N: "), or an empty string when it is well-formed. An unknown type is wrong.
/// Goodbye frames are taken as they come.
std::string checkHeader(const FrameHeader& h, uint32_t connection, uint32_t connections);
/// Checks a data frame's destination against the registered region (`found` false: not registered).
std::string checkDataTarget(const FrameHeader& h, bool found, uint64_t regionBytes);
/// Checks a flag's destination: registered, inside the region and 8-byte aligned (also as an address).
std::string checkFlagTarget(const FrameHeader& h, bool found, uint64_t regionBytes, uintptr_t regionAddr);

}  // namespace tandem::daemon::transport::tcp
