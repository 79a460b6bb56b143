#include "transport/tcp_wire.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace tandem::daemon::transport::tcp {

FrameHeader dataHeader(uint32_t regionId, uint64_t offset, uint64_t bytes) {
  FrameHeader h;
  h.type = static_cast<uint8_t>(FrameType::kData);
  h.regionId = regionId;
  h.offset = offset;
  h.length = bytes;
  return h;
}

FrameHeader flagHeader(uint32_t regionId, uint64_t offset, uint64_t value, uint32_t connections) {
  FrameHeader h;
  h.type = static_cast<uint8_t>(FrameType::kFlag);
  h.regionId = regionId;
  h.offset = offset;
  h.value = value;
  h.length = countsBytes(connections);
  return h;
}

FrameHeader messageHeader(uint64_t messageBytes, uint32_t connections) {
  FrameHeader h;
  h.type = static_cast<uint8_t>(FrameType::kMessage);
  h.length = countsBytes(connections) + messageBytes;
  h.value = messageBytes;
  return h;
}

FrameHeader heartbeatHeader() {
  FrameHeader h;
  h.type = static_cast<uint8_t>(FrameType::kHeartbeat);
  return h;
}

FrameHeader goodbyeHeader() {
  FrameHeader h;
  h.type = static_cast<uint8_t>(FrameType::kGoodbye);
  return h;
}

std::vector<std::byte> countsPayload(std::span<const uint64_t> counts, std::span<const std::byte> message) {
  std::vector<std::byte> out(counts.size_bytes() + message.size());
  if (!counts.empty()) std::memcpy(out.data(), counts.data(), counts.size_bytes());  // little-endian (static_assert)
  if (!message.empty()) std::memcpy(out.data() + counts.size_bytes(), message.data(), message.size());
  return out;
}

Chunk nextChunk(uint32_t regionId, uint64_t offset, uint64_t remaining, uint64_t chunkBytes, uint32_t connections) {
  Chunk c;
  c.offset = offset;
  c.bytes = std::min(chunkBytes - offset % chunkBytes, remaining);
  c.connection = static_cast<uint32_t>((regionId + offset / chunkBytes) % connections);
  return c;
}

std::string checkHeader(const FrameHeader& h, uint32_t connection, uint32_t connections) {
  if (h.reserved[0] != 0 || h.reserved[1] != 0 || h.reserved[2] != 0) return "reserved header bytes set";
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kHeartbeat:
      if (h.length != 0) return "heartbeat with a payload";
      return {};
    case FrameType::kGoodbye: return {};
    case FrameType::kData:
      if (h.length == 0 || h.length > kMaxFramePayload)
        return fmt::format("data frame of {} bytes (limit {})", h.length, kMaxFramePayload);
      return {};
    case FrameType::kFlag:
      if (h.length != countsBytes(connections))
        return fmt::format("flag carries {} bytes of counts, expected {}", h.length, countsBytes(connections));
      return {};
    case FrameType::kMessage:
      // value: the message's bytes, checked against the limit before anything is allocated; length: the data
      // counts (as a flag carries them) plus those bytes.
      if (connection != 0) return fmt::format("control message on connection {} (not 0)", connection);
      if (h.regionId != 0 || h.offset != 0) return "control message with a region or offset";
      if (h.value > ControlChannel::kMaxMessageBytes)
        return fmt::format("control message of {} bytes (limit {})", h.value, ControlChannel::kMaxMessageBytes);
      if (h.length != countsBytes(connections) + h.value)
        return fmt::format("control message frame of {} bytes carries {} message bytes and {} connections' counts",
                           h.length, h.value, connections);
      return {};
  }
  return fmt::format("unknown frame type {}", h.type);
}

std::string checkDataTarget(const FrameHeader& h, bool found, uint64_t regionBytes) {
  if (!found) return fmt::format("write to region {} which this node has not registered", h.regionId);
  if (!detail::inBounds(h.offset, h.length, regionBytes))
    return fmt::format("write to [{}, +{}) of region {} which has {} bytes", h.offset, h.length, h.regionId,
                       regionBytes);
  return {};
}

std::string checkFlagTarget(const FrameHeader& h, bool found, uint64_t regionBytes, uintptr_t regionAddr) {
  if (!found) return fmt::format("flag in region {} which this node has not registered", h.regionId);
  const uintptr_t addr = regionAddr + h.offset;
  if (h.offset % 8 != 0 || addr % 8 != 0 || !detail::inBounds(h.offset, 8, regionBytes))
    return fmt::format("flag at offset {} of region {} ({} bytes) is misaligned or out of bounds", h.offset,
                       h.regionId, regionBytes);
  return {};
}

}  // namespace tandem::daemon::transport::tcp
