// Single-producer/single-consumer rings in shared memory, and the region that holds a session's
// submission ring (client produces, daemon consumes) and completion ring (daemon produces, client consumes).
//
// Indices are monotonic uint64 counters that are never reset; slot = index & (capacity - 1). Head (written
// only by the producer) and tail (written only by the consumer) sit on separate 128-byte lines. A consumer
// that goes to sleep sets `consumerSleeping`; the producer rings the eventfd only when it sees that flag,
// so the busy path makes no system call. Both sides use seq_cst for the flag handshake (Dekker): the
// consumer stores the flag then re-reads head; the producer stores head then reads the flag, so at least
// one of them sees the other.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tandem/common/descriptor.hpp"

namespace tandem {

struct alignas(128) RingControl {
  alignas(128) std::atomic<uint64_t> head;  // written by the producer only
  alignas(128) std::atomic<uint64_t> tail;  // written by the consumer only
  alignas(128) std::atomic<uint32_t> consumerSleeping;
};
static_assert(sizeof(RingControl) == 384);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Index arithmetic, kept apart so it is testable with any starting values (wrap-around included).
struct RingIndex {
  static constexpr bool isPowerOfTwo(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }
  static constexpr uint64_t slot(uint64_t index, uint64_t capacity) { return index & (capacity - 1); }
  static constexpr uint64_t used(uint64_t head, uint64_t tail) { return head - tail; }  // unsigned wrap is fine
  static constexpr bool full(uint64_t head, uint64_t tail, uint64_t capacity) { return used(head, tail) >= capacity; }
  // The consumer must not trust a head written by another process: it can never be more than capacity ahead.
  static constexpr bool plausible(uint64_t head, uint64_t tail, uint64_t capacity) {
    return used(head, tail) <= capacity;
  }
};

template <typename T>
class SpscRing {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  SpscRing() = default;
  SpscRing(RingControl* control, T* slots, uint64_t capacity) : control_(control), slots_(slots), capacity_(capacity) {}

  uint64_t capacity() const { return capacity_; }
  RingControl* control() const { return control_; }

  // Producer. Returns false when full. `wakeConsumer` is set when the consumer said it sleeps.
  bool tryPush(const T& item, bool& wakeConsumer) {
    const uint64_t head = control_->head.load(std::memory_order_relaxed);
    const uint64_t tail = control_->tail.load(std::memory_order_acquire);  // pairs with release in tryPop
    if (RingIndex::full(head, tail, capacity_)) return false;
    std::memcpy(static_cast<void*>(&slots_[RingIndex::slot(head, capacity_)]), &item, sizeof(T));
    control_->head.store(head + 1, std::memory_order_seq_cst);  // release: publishes the slot
    wakeConsumer = control_->consumerSleeping.load(std::memory_order_seq_cst) != 0;
    return true;
  }

  enum class Pop { kItem, kEmpty, kCorrupt };
  // Consumer. Copies the item out before validation so the producer cannot change it afterwards.
  Pop tryPop(T& out) {
    const uint64_t tail = control_->tail.load(std::memory_order_relaxed);
    const uint64_t head = control_->head.load(std::memory_order_acquire);  // pairs with store in tryPush
    if (head == tail) return Pop::kEmpty;
    if (!RingIndex::plausible(head, tail, capacity_)) return Pop::kCorrupt;
    std::memcpy(&out, static_cast<const void*>(&slots_[RingIndex::slot(tail, capacity_)]), sizeof(T));
    control_->tail.store(tail + 1, std::memory_order_release);  // frees the slot for the producer
    return Pop::kItem;
  }

  bool empty() const {
    return control_->head.load(std::memory_order_acquire) == control_->tail.load(std::memory_order_relaxed);
  }

  // Consumer, before sleeping: announces the sleep, then re-checks. Returns true if it may sleep now;
  // false means an item arrived meanwhile (the flag is cleared again).
  bool prepareToSleep() {
    control_->consumerSleeping.store(1, std::memory_order_seq_cst);
    if (control_->head.load(std::memory_order_seq_cst) != control_->tail.load(std::memory_order_relaxed)) {
      control_->consumerSleeping.store(0, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  void wokeUp() { control_->consumerSleeping.store(0, std::memory_order_relaxed); }

 private:
  RingControl* control_ = nullptr;
  T* slots_ = nullptr;
  uint64_t capacity_ = 0;
};

// Layout of a session's ring memfd: header, then the submission ring, then the completion ring.
struct alignas(128) RingRegionHeader {
  uint64_t magic;  // kRingMagic
  uint32_t version;
  uint32_t capacity;  // both rings, a power of two
};
inline constexpr uint64_t kRingMagic = 0x74616e64656d5231ull;  // "tandemR1"

struct RingRegionLayout {
  uint64_t submissionControl, submissionSlots, completionControl, completionSlots, totalBytes;
  static RingRegionLayout forCapacity(uint32_t capacity);
};

// Views into a mapped region; the mapping must outlive the views.
struct SessionRings {
  SpscRing<OpDescriptor> submission;
  SpscRing<Completion> completion;
  // Initialises a fresh region (daemon side): zeroed counters, header written.
  static SessionRings format(std::byte* base, uint64_t bytes, uint32_t capacity);
  // Attaches to a region the daemon formatted; throws Error(kProtocol) if the header does not match.
  static SessionRings attach(std::byte* base, uint64_t bytes);
};

}  // namespace tandem
