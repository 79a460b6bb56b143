#include <doctest/doctest.h>

#include <cerrno>
#include <set>
#include <string>

#include "tandem/common/error.hpp"
#include "tandem/tandem.h"

TEST_CASE("every status has a distinct, human name") {
  std::set<std::string> names;
  for (int s = TANDEM_SUCCESS; s <= TANDEM_IN_PROGRESS; ++s) {
    const std::string name = tandem_strerror(static_cast<tandem_status_t>(s));
    CHECK(!name.empty());
    CHECK(name != "unknown error");
    names.insert(name);
  }
  CHECK(names.size() == TANDEM_IN_PROGRESS + 1);
  CHECK(std::string(tandem_strerror(TANDEM_ERROR_PEER_LOST)) == "peer lost");
  CHECK(std::string(tandem_strerror(static_cast<tandem_status_t>(999))) == "unknown error");
}

TEST_CASE("daemon-internal codes fold into wire codes") {
  using tandem::ErrorCode;
  CHECK(tandem::wireCode(ErrorCode::kInvalidConfig) == ErrorCode::kInvalidArgument);
  CHECK(tandem::wireCode(ErrorCode::kCuda) == ErrorCode::kInternal);
  CHECK(tandem::wireCode(ErrorCode::kRdma) == ErrorCode::kInternal);
  CHECK(tandem::wireCode(ErrorCode::kPeerLost) == ErrorCode::kPeerLost);
  // The C enum, the internal enum and the protobuf enum share values.
  CHECK(static_cast<int>(ErrorCode::kRingFull) == TANDEM_ERROR_RING_FULL);
  CHECK(static_cast<int>(ErrorCode::kDaemonLost) == TANDEM_ERROR_DAEMON_LOST);
}

TEST_CASE("checkErrno names the operation and the errno") {
  errno = ENOENT;
  try {
    tandem::checkErrno(-1, "open /nonexistent");
    FAIL("no throw");
  } catch (const tandem::Error& e) {
    CHECK(e.code() == tandem::ErrorCode::kSystem);
    CHECK(std::string(e.what()) == "open /nonexistent: No such file or directory [errno 2]");
  }
  errno = ENOMEM;
  CHECK_THROWS_AS(tandem::checkErrno(-1, "mmap"), tandem::Error);
  CHECK(tandem::checkErrno(5, "ok") == 5);
}
