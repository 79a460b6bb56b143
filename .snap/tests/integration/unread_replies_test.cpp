// Clients that send requests without reading a single reply, one case per request type of the control protocol.
// Each flood passes limits.max_reply_backlog_bytes, so tandemd must drop the session; meanwhile and afterwards an
// honest client is served in normal time, a QueryStatus is answered within a second, and SIGTERM stops tandemd.
//
// The join flood is the one that once wedged tandemd for good: the refusals of joins beyond
// limits.max_joining_comms_per_session were written while the engine's lock was held, the write that passed the
// backlog closed the session, and closing it took the same lock again. Every request type is flooded, so that no
// reply path (under any lock) can do that again unnoticed.
#include <doctest/doctest.h>

#include <google/protobuf/descriptor.h>

#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "harness.hpp"
#include "hostile.hpp"
#include "tandem/common/fd.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/v1/control.pb.h"

using namespace tandem::testing;
namespace pb = tandem::v1;

namespace {

// The request of each type that a flood repeats; `i` numbers it (request ids, distinct communicator ids).
using MakeRequest = std::function<void(pb::Request&, uint64_t i)>;

std::string randomId(std::mt19937_64& rng) {
  std::string id(16, '\0');
  for (auto& c : id) c = static_cast<char>(rng());
  return id;
}

const std::map<std::string, MakeRequest>& floods() {
  static const std::map<std::string, MakeRequest> table = {
      // Half-joins up to limits.max_joining_comms_per_session, then a refusal each (the reported deadlock).
      {"join_comm",
       [](pb::Request& r, uint64_t i) {
         static std::mt19937_64 rng(i);
         auto* j = r.mutable_join_comm();
         j->set_unique_id(randomId(rng));
         j->set_nranks(2);
         j->set_rank(0);
       }},
      // Buffers up to the session's fd and byte limits, each reply carrying an fd; then refusals.
      {"allocate", [](pb::Request& r, uint64_t) { r.mutable_allocate()->set_bytes(4096); }},
      // A cuda-ipc registration needs no fd; the cpu backend refuses it.
      {"register_buffer",
       [](pb::Request& r, uint64_t) {
         auto* reg = r.mutable_register_buffer();
         reg->set_kind(pb::REGISTER_KIND_CUDA_IPC);
         reg->set_bytes(4096);
       }},
      {"free", [](pb::Request& r, uint64_t i) { r.mutable_free()->set_buffer_id(1000000 + i); }},
      {"deregister", [](pb::Request& r, uint64_t i) { r.mutable_deregister()->set_buffer_id(1000000 + i); }},
      {"create_comm", [](pb::Request& r, uint64_t) { r.mutable_create_comm(); }},
      {"destroy_comm",
       [](pb::Request& r, uint64_t i) {
         r.mutable_destroy_comm()->set_comm_handle(1000000 + i);
         r.mutable_destroy_comm()->set_abort(i % 2 == 0);
       }},
      {"comm_mapping", [](pb::Request& r, uint64_t i) { r.mutable_comm_mapping()->set_comm_handle(1000000 + i); }},
      {"query_status", [](pb::Request& r, uint64_t) { r.mutable_query_status(); }},
      {"set_plan", [](pb::Request& r, uint64_t i) { r.mutable_set_plan()->set_comm_handle(1000000 + i); }},
      // A request with no body: refused as a protocol error, and the session stays.
      {"(no body)", [](pb::Request&, uint64_t) {}},
  };
  return table;
}

// Request types no flood covers, and why.
const std::map<std::string, std::string>& notFlooded() {
  static const std::map<std::string, std::string> table = {
      {"hello", "the first request of every connection, and a second one ends it (the flood's own Hello is it)"},
      {"shutdown", "stops tandemd by design for root and its own user (these tests' uid); refused for others"},
  };
  return table;
}

// A QueryStatus on a fresh connection: milliseconds to its answer, or -1 without one within timeoutMs.
long statusRoundTripMs(const std::string& socket, int timeoutMs) {
  const auto t0 = Clock::now();
  tandem::Fd fd = rawConnect(socket);
  sendAll(fd.get(), helloFrame());
  if (!readResponse(fd.get(), timeoutMs)) return -1;
  sendAll(fd.get(), queryStatusFrame(2));
  const auto reply = readResponse(fd.get(), timeoutMs);
  if (!reply || !reply->has_status_reply()) return -1;
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

}  // namespace

TEST_SUITE("hostile clients: unread replies") {
  TEST_CASE("every request type of the control protocol has a flood, or a stated reason for none") {
    const auto* body = pb::Request::descriptor()->FindOneofByName("body");
    REQUIRE(body != nullptr);
    for (int i = 0; i < body->field_count(); ++i) {
      const std::string name(body->field(i)->name());
      INFO("request type " << name << ": add a flood for it to unread_replies_test.cpp");
      CHECK((floods().contains(name) || notFlooded().contains(name)));
    }
  }

  TEST_CASE("a client that floods one request type without reading is dropped; tandemd keeps serving and stops") {
    for (const auto& [name, make] : floods()) {
      SUBCASE(name.c_str()) {
        Daemon d(std::string(kFastLimits) + "  max_frame_bytes: 16384\n  max_reply_backlog_bytes: 65536\n");
        const Baseline b = baseline(d);
        tandem::Fd greedy = rawConnect(d.socket());
        sendAll(greedy.get(), helloFrame());
        REQUIRE(readResponse(greedy.get(), 2000).has_value());
        std::string burst;
        for (uint64_t i = 0; i < 20000; ++i) {
          pb::Request r;
          r.set_request_id(i + 2);
          make(r, i);
          burst += frameOf(r);
        }
        std::thread writer([&] {
          std::string_view rest(burst);
          while (!rest.empty()) {
            const ssize_t n = ::send(greedy.get(), rest.data(), rest.size(), MSG_NOSIGNAL);
            if (n <= 0) break;  // tandemd hung up on us
            rest.remove_prefix(static_cast<std::size_t>(n));
          }
        });
        // Dropped for its backlog...
        const bool dropped =
            eventually([&] { return d.log().find("did not read its replies") != std::string::npos; }, 10000);
        CHECK_MESSAGE(dropped, "flood " << name << ": tandemd never dropped the client; its log:\n" << d.log());
        // ...while others are served: a status within a second, an honest op in normal time.
        const long statusMs = statusRoundTripMs(d.socket(), 5000);
        MESSAGE("flood " << name << ": a QueryStatus answered in " << statusMs << " ms");
        CHECK(statusMs >= 0);
        CHECK(statusMs < 1000);
        ::shutdown(greedy.get(), SHUT_RDWR);
        writer.join();
        greedy.reset();
        checkRecovered(d, b, "20000 unread " + name + " requests");
      }
    }
  }
}
