// The daemon's lock order (common/include/tandem/common/ranked_mutex.hpp): inner locks may be taken under outer
// ones; re-entry and inversion stop the process with both names instead of deadlocking. The stopping cases run in a
// forked child, whose signal and stderr are checked.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "tandem/common/ranked_mutex.hpp"

using tandem::LockRank;
using tandem::RankedMutex;

namespace {

struct ChildEnd {
  int signal = 0;  // the signal that ended it, 0 if it exited
  std::string err;
};

ChildEnd runInChild(const std::function<void()>& body) {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(p[1], 2);
    body();
    std::_Exit(0);
  }
  ::close(p[1]);
  ChildEnd end;
  char buf[1024];
  for (ssize_t n; (n = ::read(p[0], buf, sizeof buf)) > 0;) end.err.append(buf, static_cast<std::size_t>(n));
  ::close(p[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  end.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  return end;
}

}  // namespace

TEST_SUITE("ranked mutex") {
  TEST_CASE("outer then inner is allowed, and a condition variable waits on a ranked mutex") {
    RankedMutex outer(LockRank::kEngine, "outer"), inner(LockRank::kChannel, "inner");
    {
      std::lock_guard a(outer);
      CHECK(outer.heldByThisThread());
      std::lock_guard b(inner);
      CHECK(inner.heldByThisThread());
    }
    CHECK_FALSE(outer.heldByThisThread());
    CHECK_FALSE(inner.heldByThisThread());
    // unique_lock may release out of order.
    std::unique_lock a(outer);
    std::unique_lock b(inner);
    a.unlock();
    CHECK(inner.heldByThisThread());
    b.unlock();
    std::condition_variable_any cv;
    bool ready = false;
    std::thread t([&] {
      std::lock_guard l(outer);
      ready = true;
      cv.notify_one();
    });
    {
      std::unique_lock l(outer);
      cv.wait(l, [&] { return ready; });
      CHECK(outer.heldByThisThread());
    }
    t.join();
  }

  TEST_CASE("re-entering a held mutex stops the process, naming it") {
    const ChildEnd end = runInChild([] {
      RankedMutex engine(LockRank::kEngine, "Engine");
      std::lock_guard a(engine);
      std::lock_guard b(engine);  // would self-deadlock
    });
    CHECK(end.signal == SIGABRT);
    CHECK(end.err.find("re-entering Engine") != std::string::npos);
  }

  TEST_CASE("taking an outer mutex under an inner one stops the process, naming both") {
    const ChildEnd end = runInChild([] {
      RankedMutex engine(LockRank::kEngine, "Engine"), channel(LockRank::kChannel, "SessionChannel");
      std::lock_guard a(channel);
      std::lock_guard b(engine);
    });
    CHECK(end.signal == SIGABRT);
    CHECK(end.err.find("taking Engine (rank 10) while holding SessionChannel (rank 90)") != std::string::npos);
  }

  TEST_CASE("a path that must run unlocked stops the process when the lock is held") {
    const ChildEnd end = runInChild([] {
      RankedMutex engine(LockRank::kEngine, "Engine");
      engine.assertNotHeld("a join's reply");  // not held: nothing happens
      std::lock_guard a(engine);
      engine.assertNotHeld("a join's reply");
    });
    CHECK(end.signal == SIGABRT);
    CHECK(end.err.find("a join's reply runs with Engine held") != std::string::npos);
  }
}
