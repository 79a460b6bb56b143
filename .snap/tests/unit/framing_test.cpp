#include <doctest/doctest.h>
#include <sys/socket.h>

#include <random>

#include "tandem/common/error.hpp"
#include "tandem/common/framing.hpp"
#include "tandem/v1/control.pb.h"

using tandem::Error;
using tandem::ErrorCode;
using tandem::FrameDecoder;

namespace {
std::span<const std::byte> bytes(const std::string& s) { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }
}  // namespace

TEST_CASE("frames round-trip, whole or byte by byte") {
  const std::string a = tandem::encodeFrame("hello", 64), b = tandem::encodeFrame("", 64);
  CHECK(a.size() == 4 + 5);
  CHECK(a.substr(0, 4) == std::string("\x05\x00\x00\x00", 4));  // little-endian length
  FrameDecoder whole(64);
  whole.append(bytes(a + b));
  CHECK(whole.next() == "hello");
  CHECK(whole.next() == "");
  CHECK(!whole.next());

  FrameDecoder trickle(64);
  for (char c : a) {
    CHECK(!trickle.next());
    trickle.append(bytes(std::string(1, c)));
  }
  CHECK(trickle.next() == "hello");
}

TEST_CASE("a truncated frame waits and reports that it is mid-frame") {
  const std::string f = tandem::encodeFrame("abcdef", 64);
  FrameDecoder d(64);
  d.append(bytes(f.substr(0, 7)));
  CHECK(!d.next());
  CHECK(d.midFrame());
}

TEST_CASE("oversized frames are refused on both sides with both numbers") {
  CHECK_THROWS_WITH_AS(tandem::encodeFrame(std::string(65, 'x'), 64), doctest::Contains("65 bytes"), Error);
  FrameDecoder d(64);
  d.append(bytes(std::string("\x41\x00\x00\x00", 4)));
  try {
    d.next();
    FAIL("accepted an oversized frame");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kProtocol);
    CHECK(std::string(e.what()).find("65 bytes") != std::string::npos);
    CHECK(std::string(e.what()).find("64 bytes") != std::string::npos);
  }
}

TEST_CASE("frames and fds cross a real socket pair") {
  int sv[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  tandem::Fd a(sv[0]), b(sv[1]);
  tandem::Fd ev = tandem::Fd::eventfd();
  const int fds[] = {ev.get()};
  tandem::sendFrame(a.get(), "with-fd", fds, 1024);
  tandem::sendFrame(a.get(), "plain", {}, 1024);
  FrameDecoder d(1024);
  CHECK(tandem::recvFrame(b.get(), d, 1000) == "with-fd");
  tandem::Fd got = d.takeFd();
  CHECK(got.get() >= 0);
  CHECK(got.get() != ev.get());
  CHECK(tandem::recvFrame(b.get(), d, 1000) == "plain");
  CHECK_THROWS_WITH_AS(d.takeFd(), doctest::Contains("none arrived"), Error);
  CHECK_THROWS_WITH_AS(tandem::recvFrame(b.get(), d, 10), doctest::Contains("within 10 ms"), Error);
  a.reset();
  CHECK_THROWS_WITH_AS(tandem::recvFrame(b.get(), d, 1000), doctest::Contains("closed"), Error);
}

TEST_CASE("fuzz: the frame decoder never crashes and never returns a frame over the limit") {
  // Seeded, so a failure reproduces. 100,000 random byte streams, including valid frames with garbage around.
  std::mt19937_64 rng(12345);
  constexpr std::size_t kLimit = 256;
  std::size_t frames = 0, rejected = 0;
  for (int round = 0; round < 100000; ++round) {
    FrameDecoder d(kLimit);
    std::string stream;
    const int parts = static_cast<int>(rng() % 4) + 1;
    for (int p = 0; p < parts; ++p) {
      if (rng() % 2) {
        stream += tandem::encodeFrame(std::string(rng() % kLimit, static_cast<char>(rng())), kLimit);
      } else {
        std::string junk(rng() % 16, '\0');
        for (char& c : junk) c = static_cast<char>(rng());
        stream += junk;
      }
    }
    try {
      std::size_t pos = 0;
      while (pos < stream.size()) {
        const std::size_t n = std::min<std::size_t>(stream.size() - pos, rng() % 40 + 1);
        d.append(bytes(stream.substr(pos, n)));
        pos += n;
        while (auto f = d.next()) {
          REQUIRE(f->size() <= kLimit);
          // A decoded frame must also survive protobuf parsing without crashing (it may fail to parse).
          tandem::v1::Request r;
          (void)r.ParseFromString(*f);
          ++frames;
        }
      }
    } catch (const Error& e) {
      REQUIRE(e.code() == ErrorCode::kProtocol);
      ++rejected;
    }
  }
  CHECK(frames > 10000);
  CHECK(rejected > 1000);
}
