#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "tandem/common/descriptor.hpp"
#include "tandem/common/error.hpp"
#include "tandem/common/ring.hpp"

using tandem::RingIndex;

TEST_CASE("ring index arithmetic wraps with unsigned counters") {
  CHECK(RingIndex::isPowerOfTwo(256));
  CHECK(!RingIndex::isPowerOfTwo(0));
  CHECK(!RingIndex::isPowerOfTwo(96));
  const uint64_t max = std::numeric_limits<uint64_t>::max();
  CHECK(RingIndex::slot(max, 8) == 7);
  CHECK(RingIndex::slot(max + 1, 8) == 0);  // wraps to 0
  CHECK(RingIndex::used(2, max - 1) == 4);  // head wrapped past tail
  CHECK(RingIndex::full(max - 1 + 8, max - 1, 8));
  CHECK(!RingIndex::full(max - 1 + 7, max - 1, 8));
  CHECK(RingIndex::plausible(5, 5, 8));
  CHECK(!RingIndex::plausible(14, 5, 8));  // a head more than capacity ahead is corrupt
  CHECK(!RingIndex::plausible(4, 5, 8));   // a head behind the tail is corrupt
}

TEST_CASE("descriptor and completion layouts are fixed") {
  CHECK(sizeof(tandem::OpDescriptor) == 384);
  CHECK(offsetof(tandem::OpDescriptor, dims) == 40);
  CHECK(offsetof(tandem::OpDescriptor, bufs) == 104);
  CHECK(sizeof(tandem::Completion) == 192);
  CHECK(sizeof(tandem::RingControl) == 384);
  CHECK(offsetof(tandem::RingControl, tail) == 128);
  CHECK(offsetof(tandem::RingControl, consumerSleeping) == 256);
}

TEST_CASE("the balanced row split covers every row exactly once") {
  for (uint32_t n = 1; n <= 64; ++n) {
    for (uint64_t total : {0ull, 1ull, 7ull, 64ull, 1000ull}) {
      uint64_t next = 0;
      for (uint32_t r = 0; r < n; ++r) {
        CHECK(tandem::rowOffset(total, r, n) == next);
        next += tandem::rowsOf(total, r, n);
      }
      CHECK(next == total);
    }
  }
}

TEST_CASE("an SPSC ring in a region: push, pop, full, wrap-around, sleep flag") {
  const uint32_t capacity = 8;
  const auto layout = tandem::RingRegionLayout::forCapacity(capacity);
  std::vector<std::byte> region(layout.totalBytes + 128);
  auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(region.data()) + 127) & ~uintptr_t{127});
  auto rings = tandem::SessionRings::format(base, layout.totalBytes, capacity);
  auto view = tandem::SessionRings::attach(base, layout.totalBytes);
  auto& producer = rings.submission;
  auto& consumer = view.submission;

  tandem::OpDescriptor d{};
  bool wake = false;
  for (uint64_t round = 0; round < 5; ++round) {  // 40 pushes: the slots wrap several times
    for (uint64_t i = 0; i < capacity; ++i) {
      d.seq = round * capacity + i;
      REQUIRE(producer.tryPush(d, wake));
      CHECK(!wake);
    }
    CHECK(!producer.tryPush(d, wake));  // full
    for (uint64_t i = 0; i < capacity; ++i) {
      tandem::OpDescriptor out{};
      REQUIRE(consumer.tryPop(out) == tandem::SpscRing<tandem::OpDescriptor>::Pop::kItem);
      CHECK(out.seq == round * capacity + i);
    }
    tandem::OpDescriptor out{};
    CHECK(consumer.tryPop(out) == tandem::SpscRing<tandem::OpDescriptor>::Pop::kEmpty);
  }
  // Sleep handshake: a consumer that announced sleep gets a wake-up request from the next push.
  REQUIRE(consumer.prepareToSleep());
  REQUIRE(producer.tryPush(d, wake));
  CHECK(wake);
  consumer.wokeUp();
  CHECK(!consumer.prepareToSleep());  // an item is waiting: it must not sleep

  // A corrupt head (more than capacity ahead) is detected, not trusted.
  rings.submission.control()->head.store(rings.submission.control()->tail.load() + 100);
  tandem::OpDescriptor out{};
  CHECK(consumer.tryPop(out) == tandem::SpscRing<tandem::OpDescriptor>::Pop::kCorrupt);

  // A region with a bad magic is refused.
  reinterpret_cast<tandem::RingRegionHeader*>(base)->magic = 0;
  CHECK_THROWS_AS(tandem::SessionRings::attach(base, layout.totalBytes), tandem::Error);
}

TEST_CASE("an SPSC ring carries a million items between two threads in order") {
  const uint32_t capacity = 64;
  const auto layout = tandem::RingRegionLayout::forCapacity(capacity);
  std::vector<std::byte> region(layout.totalBytes + 128);
  auto* base = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(region.data()) + 127) & ~uintptr_t{127});
  auto rings = tandem::SessionRings::format(base, layout.totalBytes, capacity);
  constexpr uint64_t kItems = 1'000'000;
  std::thread producer([&] {
    tandem::Completion c{};
    bool wake;
    for (uint64_t i = 0; i < kItems; ++i) {
      c.seq = i;
      while (!rings.completion.tryPush(c, wake)) std::this_thread::yield();
    }
  });
  uint64_t expected = 0;
  bool ordered = true;
  tandem::Completion c{};
  while (expected < kItems) {
    const auto r = rings.completion.tryPop(c);
    if (r == tandem::SpscRing<tandem::Completion>::Pop::kItem) {
      ordered = ordered && c.seq == expected;
      ++expected;
    }
  }
  producer.join();
  CHECK(ordered);
}
