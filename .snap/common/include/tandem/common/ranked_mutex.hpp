// A mutex with a place in the daemon's lock order, checked on every acquisition.
//
// tandemd's shared state is guarded by a few long-lived mutexes that nest (the engine's maps, then a backend's
// state, then the cluster's, then a session's completion ring). A thread may take a ranked mutex only while every
// ranked mutex it already holds has a lower rank. Re-entering a mutex the thread holds (a callback that comes back
// into the engine while the engine's lock is held) or taking one out of order would hang the daemon for every
// client, silently; here it stops the process at once, naming both locks, so that tests fail loudly and systemd
// restarts a production daemon instead of leaving it wedged. docs/ARCHITECTURE.md ("Locks and callbacks") lists
// the order and the rule that goes with it: nothing calls back into a session, the server or a client-facing path
// while holding one of these.
//
// Meets the Lockable requirements (std::lock_guard, std::unique_lock, std::condition_variable_any).
#pragma once

#include <cstdint>
#include <mutex>

namespace tandem {

// Outermost first. Gaps leave room; two mutexes of one rank are never held together.
enum class LockRank : uint16_t {
  kEngine = 10,        // Engine: sessions, buffers, communicators
  kPlanTable = 20,     // PlanTable: the plan records
  kBackend = 30,       // a backend's own state (cpu work queue, cuda communicators)
  kClusterSend = 40,   // Cluster: one sender at a time
  kCluster = 45,       // Cluster: nodes, links
  kLink = 50,          // CommLink: staging keys, abort state
  kClusterEvents = 60, // Cluster: the event queue the engine is told through
  kChannel = 90,       // SessionChannel: one producer on a completion ring (innermost)
};

class RankedMutex {
 public:
  RankedMutex(LockRank rank, const char* name) : rank_(rank), name_(name) {}
  RankedMutex(const RankedMutex&) = delete;
  RankedMutex& operator=(const RankedMutex&) = delete;

  void lock();
  bool try_lock();
  void unlock();

  // Whether the calling thread holds this mutex.
  bool heldByThisThread() const;
  // Stops the process, naming `what`, if the calling thread holds this mutex: for paths that must run unlocked
  // (callbacks into sessions and the server).
  void assertNotHeld(const char* what) const;

  LockRank rank() const { return rank_; }
  const char* name() const { return name_; }

 private:
  std::mutex mutex_;
  LockRank rank_;
  const char* name_;
};

}  // namespace tandem
