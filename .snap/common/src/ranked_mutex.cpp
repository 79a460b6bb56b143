#include "tandem/common/ranked_mutex.hpp"

#include <array>
#include <cstdio>
#include <cstdlib>

namespace tandem {
namespace {

// What this thread holds, in acquisition order. Nesting is shallow (a handful of ranks), so a fixed array and a
// linear scan cost less than the lock itself.
constexpr std::size_t kMaxHeld = 16;
struct Held {
  std::array<const RankedMutex*, kMaxHeld> locks{};
  std::size_t count = 0;
};
thread_local Held held;

[[noreturn]] void die(const char* what, const RankedMutex& taking, const RankedMutex* holding) {
  // stderr reaches the journal under systemd; spdlog may itself be what is locked, so it is not used here.
  if (holding != nullptr) {
    std::fprintf(stderr, "tandem: lock order violated: %s %s (rank %u) while holding %s (rank %u); this would "
                 "deadlock. Stopping instead of hanging\n", what, taking.name(), static_cast<unsigned>(taking.rank()),
                 holding->name(), static_cast<unsigned>(holding->rank()));
  } else {
    std::fprintf(stderr, "tandem: lock order violated: %s (%s held)\n", what, taking.name());
  }
  std::fflush(stderr);
  std::abort();
}

void checkBefore(const RankedMutex& m) {
  for (std::size_t i = 0; i < held.count; ++i) {
    const RankedMutex* h = held.locks[i];
    if (h == &m) die("re-entering", m, h);
    if (h->rank() >= m.rank()) die("taking", m, h);
  }
  if (held.count == kMaxHeld) die("too many nested locks", m, nullptr);
}

void push(const RankedMutex& m) { held.locks[held.count++] = &m; }

}  // namespace

void RankedMutex::lock() {
  checkBefore(*this);
  mutex_.lock();
  push(*this);
}

bool RankedMutex::try_lock() {
  // A try cannot deadlock, but re-entry is still a bug (it would fail every time).
  for (std::size_t i = 0; i < held.count; ++i) {
    if (held.locks[i] == this) die("re-entering (try_lock)", *this, this);
  }
  if (held.count == kMaxHeld || !mutex_.try_lock()) return false;
  push(*this);
  return true;
}

void RankedMutex::unlock() {
  // Usually the last one taken, but unique_lock may release out of order.
  for (std::size_t i = held.count; i-- > 0;) {
    if (held.locks[i] == this) {
      for (std::size_t j = i + 1; j < held.count; ++j) held.locks[j - 1] = held.locks[j];
      --held.count;
      break;
    }
  }
  mutex_.unlock();
}

bool RankedMutex::heldByThisThread() const {
  for (std::size_t i = 0; i < held.count; ++i) {
    if (held.locks[i] == this) return true;
  }
  return false;
}

void RankedMutex::assertNotHeld(const char* what) const {
  if (!heldByThisThread()) return;
  std::fprintf(stderr, "tandem: %s runs with %s held; callbacks into sessions and the server must run unlocked. "
               "Stopping instead of risking a deadlock\n", what, name_);
  std::fflush(stderr);
  std::abort();
}

}  // namespace tandem
