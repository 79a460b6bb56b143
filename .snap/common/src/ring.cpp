#include "tandem/common/ring.hpp"

#include <new>

#include "tandem/common/error.hpp"

namespace tandem {
namespace {
constexpr uint64_t alignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

RingRegionLayout RingRegionLayout::forCapacity(uint32_t capacity) {
  RingRegionLayout l{};
  l.submissionControl = alignUp(sizeof(RingRegionHeader), 128);
  l.submissionSlots = l.submissionControl + sizeof(RingControl);
  l.completionControl = alignUp(l.submissionSlots + uint64_t{capacity} * sizeof(OpDescriptor), 128);
  l.completionSlots = l.completionControl + sizeof(RingControl);
  l.totalBytes = alignUp(l.completionSlots + uint64_t{capacity} * sizeof(Completion), 4096);
  return l;
}

static SessionRings views(std::byte* base, uint32_t capacity) {
  const auto l = RingRegionLayout::forCapacity(capacity);
  SessionRings r;
  r.submission = SpscRing<OpDescriptor>(reinterpret_cast<RingControl*>(base + l.submissionControl),
                                        reinterpret_cast<OpDescriptor*>(base + l.submissionSlots), capacity);
  r.completion = SpscRing<Completion>(reinterpret_cast<RingControl*>(base + l.completionControl),
                                      reinterpret_cast<Completion*>(base + l.completionSlots), capacity);
  return r;
}

SessionRings SessionRings::format(std::byte* base, uint64_t bytes, uint32_t capacity) {
  if (!RingIndex::isPowerOfTwo(capacity)) fail(ErrorCode::kInvalidConfig, "ring capacity {} is not a power of two", capacity);
  const auto l = RingRegionLayout::forCapacity(capacity);
  if (bytes < l.totalBytes) fail(ErrorCode::kInternal, "ring region of {} bytes is smaller than {}", bytes, l.totalBytes);
  auto* header = new (base) RingRegionHeader{};
  header->version = kDescriptorVersion;
  header->capacity = capacity;
  new (base + l.submissionControl) RingControl{};
  new (base + l.completionControl) RingControl{};
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kRingMagic;
  return views(base, capacity);
}

SessionRings SessionRings::attach(std::byte* base, uint64_t bytes) {
  if (bytes < sizeof(RingRegionHeader)) fail(ErrorCode::kProtocol, "ring region of {} bytes is too small", bytes);
  const auto* header = reinterpret_cast<const RingRegionHeader*>(base);
  if (header->magic != kRingMagic) fail(ErrorCode::kProtocol, "ring region has a bad magic number");
  if (header->version != kDescriptorVersion) {
    fail(ErrorCode::kVersionMismatch, "ring descriptor version {} from tandemd, but this libtandem uses {}. "
         "Use a libtandem built from the same release as tandemd", header->version, kDescriptorVersion);
  }
  const auto l = RingRegionLayout::forCapacity(header->capacity);
  if (!RingIndex::isPowerOfTwo(header->capacity) || bytes < l.totalBytes) {
    fail(ErrorCode::kProtocol, "ring region header is inconsistent (capacity {}, {} bytes)", header->capacity, bytes);
  }
  return views(base, header->capacity);
}

}  // namespace tandem
