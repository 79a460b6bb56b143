// Host-only tests of the tcp transport's pure logic: the handshake (HMAC-SHA256 against RFC 4231, MAC comparison,
// message layouts, checks, the texts both sides report), the framing (headers, striping, frame checks) and the
// per-peer state (life cycle and rejoin, arrival order, completion tracking). No sockets.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "transport/tcp_handshake.hpp"
#include "transport/tcp_peer.hpp"
#include "transport/tcp_wire.hpp"

using namespace tandem;
using namespace tandem::daemon::transport;

namespace {

std::string hex(std::span<const uint8_t> d) {
  std::string s;
  for (uint8_t b : d) s += fmt::format("{:02x}", b);
  return s;
}
std::vector<std::byte> bytesOf(const std::string& s) {
  std::vector<std::byte> v(s.size());
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}
std::vector<std::byte> repeated(std::size_t n, uint8_t b) { return std::vector<std::byte>(n, std::byte{b}); }

}  // namespace

// =========================================================================================================
// Crypto
// =========================================================================================================

TEST_CASE("HMAC-SHA256 matches every RFC 4231 test vector") {
  // Test case 1: a 20-byte key.
  CHECK(hex(tcp::hmacSha256(repeated(20, 0x0b), bytesOf("Hi There"))) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 2: a key shorter than the digest.
  CHECK(hex(tcp::hmacSha256(bytesOf("Jefe"), bytesOf("what do ya want for nothing?"))) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 3: key and data of bytes that are not text.
  CHECK(hex(tcp::hmacSha256(repeated(20, 0xaa), repeated(50, 0xdd))) ==
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  // Test case 4: a 25-byte key 0x01..0x19.
  std::vector<std::byte> key4(25);
  for (std::size_t i = 0; i < key4.size(); ++i) key4[i] = static_cast<std::byte>(i + 1);
  CHECK(hex(tcp::hmacSha256(key4, repeated(50, 0xcd))) ==
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  // Test case 5: the RFC gives only the first 128 bits.
  const auto t5 = tcp::hmacSha256(repeated(20, 0x0c), bytesOf("Test With Truncation"));
  CHECK(hex(std::span(t5).first(16)) == "a3b6167473100ee06e0c796c2955552b");
  // Test case 6: a key longer than the block size is hashed first.
  CHECK(hex(tcp::hmacSha256(repeated(131, 0xaa), bytesOf("Test Using Larger Than Block-Size Key - Hash Key First"))) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // Test case 7: key and data both longer than the block size.
  CHECK(hex(tcp::hmacSha256(repeated(131, 0xaa),
                               bytesOf("This is a test using a larger than block-size key and a larger than block-size "
                                       "data. The key needs to be hashed before being used by the HMAC algorithm."))) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST_CASE("HMAC-SHA256 takes an empty key and an empty message") {
  // RFC 2104 pads any key, the empty one included, to the block size; OpenSSL's CLI gives the same value
  // (`printf '' | openssl dgst -sha256 -hmac ''`).
  CHECK(hex(tcp::hmacSha256({}, {})) == "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

TEST_CASE("MACs compare equal only when every byte and the length match") {
  const auto a = repeated(32, 7);
  auto b = a;
  CHECK(tcp::macEqual(a, b));
  for (std::size_t i : {std::size_t{0}, std::size_t{17}, std::size_t{31}}) {
    b = a;
    b[i] ^= std::byte{1};
    CHECK_FALSE(tcp::macEqual(a, b));
  }
  CHECK_FALSE(tcp::macEqual(std::span(a).first(31), a));
  CHECK(tcp::macEqual({}, {}));
}

TEST_CASE("handshake nonces are random: no two of a thousand are equal") {
  std::set<tcp::Nonce> seen;
  for (int i = 0; i < 1000; ++i) seen.insert(tcp::randomNonce());
  CHECK(seen.size() == 1000);
}

// =========================================================================================================
// Handshake
// =========================================================================================================

namespace {
tcp::Hello someHello() {
  tcp::Hello h;
  h.version = 7;
  h.from = 2;
  h.to = 0;
  h.connIndex = 1;
  h.connCount = 3;
  for (std::size_t i = 0; i < h.nonce.size(); ++i) h.nonce[i] = static_cast<std::byte>(0xa0 + i);
  return h;
}
const tcp::AcceptorIdentity kAcceptor{0, 3, 7, 3};  // node 0 of 3, version 7, 3 connections per peer
}  // namespace

TEST_CASE("handshake messages keep their fixed little-endian layout and decode to the same fields") {
  const tcp::Hello h = someHello();
  const tcp::HelloBytes hb = tcp::encodeHello(h);
  // The layout every release shares: magic, version, from, to, index, count, reserved, nonce.
  uint64_t magic = 0;
  std::memcpy(&magic, hb.data(), 8);
  CHECK(magic == 0x3150435444464e54ull);
  std::array<uint32_t, 6> fields{};
  std::memcpy(fields.data(), hb.data() + 8, sizeof fields);
  CHECK(fields == std::array<uint32_t, 6>{7, 2, 0, 1, 3, 0});
  CHECK(std::equal(h.nonce.begin(), h.nonce.end(), hb.begin() + 32));
  const auto back = tcp::decodeHello(hb);
  REQUIRE(back.has_value());
  CHECK(back->version == 7);
  CHECK(back->from == 2);
  CHECK(back->to == 0);
  CHECK(back->connIndex == 1);
  CHECK(back->connCount == 3);
  CHECK(back->nonce == h.nonce);
  tcp::HelloBytes bad = hb;
  bad[0] ^= std::byte{1};
  CHECK_FALSE(tcp::decodeHello(bad).has_value());

  const tcp::Reply r{7, tcp::HandshakeStatus::kConnMismatch, 0, 3, h.nonce};
  const tcp::ReplyBytes rb = tcp::encodeReply(r, "s3cret", hb);
  uint32_t status = 0;
  std::memcpy(&status, rb.data() + 12, 4);
  CHECK(status == 4);
  const auto rback = tcp::decodeReply(rb);
  REQUIRE(rback.has_value());
  CHECK(rback->version == 7);
  CHECK(rback->status == tcp::HandshakeStatus::kConnMismatch);
  CHECK(rback->node == 0);
  CHECK(rback->connCount == 3);
  tcp::ReplyBytes badReply = rb;
  badReply[7] ^= std::byte{0x80};
  CHECK_FALSE(tcp::decodeReply(badReply).has_value());

  for (auto s : {tcp::HandshakeStatus::kOk, tcp::HandshakeStatus::kBadSecret, tcp::HandshakeStatus::kDuplicate})
    CHECK(tcp::decodeResult(tcp::encodeResult(s)) == s);
}

TEST_CASE("both MACs verify only under the same secret, the same Hello and the same reply") {
  const tcp::HelloBytes hello = tcp::encodeHello(someHello());
  const tcp::ReplyBytes reply =
      tcp::encodeReply(tcp::Reply{7, tcp::HandshakeStatus::kOk, 0, 3, tcp::randomNonce()}, "secret-A", hello);
  CHECK(tcp::acceptorMacValid("secret-A", hello, reply));
  CHECK_FALSE(tcp::acceptorMacValid("secret-B", hello, reply));
  const tcp::AuthBytes auth = tcp::dialerAuth("secret-A", hello, reply);
  CHECK(tcp::dialerAuthValid("secret-A", hello, reply, auth));
  CHECK_FALSE(tcp::dialerAuthValid("secret-B", hello, reply, auth));
  // The dialer's MAC is not the acceptor's (the role labels differ), so neither can be reflected back.
  CHECK_FALSE(tcp::macEqual(auth, std::span<const std::byte>(reply).subspan(tcp::kReplyPrefixBytes)));
  // Any changed byte of the Hello or the reply fields (a replayed nonce, another node index) breaks both.
  for (std::size_t i : {std::size_t{12}, std::size_t{40}}) {
    tcp::HelloBytes h2 = hello;
    h2[i] ^= std::byte{1};
    CHECK_FALSE(tcp::acceptorMacValid("secret-A", h2, reply));
    CHECK_FALSE(tcp::dialerAuthValid("secret-A", h2, reply, auth));
  }
  tcp::ReplyBytes r2 = reply;
  r2[30] ^= std::byte{1};  // the acceptor's nonce
  CHECK_FALSE(tcp::acceptorMacValid("secret-A", hello, r2));
  CHECK_FALSE(tcp::dialerAuthValid("secret-A", hello, r2, auth));
  // The MAC is HMAC-SHA256(secret, role label | Hello | reply fields), as a raw dialer computes it.
  std::vector<std::byte> input = bytesOf("tandem-tcp dialer");
  input.insert(input.end(), hello.begin(), hello.end());
  input.insert(input.end(), reply.begin(), reply.begin() + tcp::kReplyPrefixBytes);
  const auto direct = tcp::hmacSha256(bytesOf("secret-A"), input);
  CHECK(tcp::macEqual(std::as_bytes(std::span(direct)), auth));
}

TEST_CASE("the acceptor checks version, addressee, sender and connection count, in that order") {
  tcp::Hello h = someHello();
  CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kOk);
  CHECK(tcp::helloFromValid(h, kAcceptor));
  SUBCASE("a different version beats everything else") {
    h.version = 8;
    h.to = 5;
    h.connCount = 1;
    CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kVersionMismatch);
  }
  SUBCASE("addressed to another node") {
    h.to = 1;
    CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kWrongNode);
  }
  SUBCASE("from itself or from outside the cluster") {
    h.from = 0;
    CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kBadNode);
    CHECK_FALSE(tcp::helloFromValid(h, kAcceptor));
    h.from = 3;
    CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kBadNode);
  }
  SUBCASE("another connection count, or an index outside it") {
    h.connCount = 2;
    h.connIndex = 0;
    CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kConnMismatch);
    h.connCount = 3;
    h.connIndex = 3;
    CHECK(tcp::checkHello(h, kAcceptor) == tcp::HandshakeStatus::kConnMismatch);
  }
}

TEST_CASE("a mismatch reads the same on both sides and names the key that fixes it") {
  const std::string who = "127.0.0.2:7100 (node 1)";
  CHECK(tcp::versionMismatchMessage(who, 3, 2) ==
        "tcp transport: peer 127.0.0.2:7100 (node 1) speaks protocol version 3, this node speaks 2; run the same "
        "tandem release on every node");
  CHECK(tcp::connectionCountMismatchMessage(who, 4, 2) ==
        "tcp transport: peer 127.0.0.2:7100 (node 1) uses 4 connections per peer, this node 2; set "
        "cluster.connections_per_peer identically on every node");
  CHECK(tcp::secretMismatchMessage(who) ==
        "tcp transport: peer 127.0.0.2:7100 (node 1) presented a different cluster secret; set cluster.secret "
        "identically on every node");
}

// =========================================================================================================
// Framing
// =========================================================================================================

TEST_CASE("a write is cut at destination chunk boundaries and each chunk keeps its connection") {
  constexpr uint64_t kChunk = 4096;
  struct Piece {
    uint32_t connection;
    uint64_t offset, bytes;
    bool operator==(const Piece&) const = default;
  };
  auto cut = [&](uint32_t region, uint64_t offset, uint64_t bytes, uint32_t conns) {
    std::vector<Piece> pieces;
    for (uint64_t done = 0; done < bytes;) {
      const tcp::Chunk c = tcp::nextChunk(region, offset + done, bytes - done, kChunk, conns);
      pieces.push_back({c.connection, c.offset, c.bytes});
      done += c.bytes;
    }
    return pieces;
  };
  // Region 5, three connections: chunk i of the region goes on (5 + i) % 3.
  CHECK(cut(5, 1000, 10000, 3) ==
        std::vector<Piece>{{2, 1000, 3096}, {0, 4096, 4096}, {1, 8192, 2808}});
  CHECK(cut(5, 0, 100, 3) == std::vector<Piece>{{2, 0, 100}});
  CHECK(cut(0, 4096, 4096, 1) == std::vector<Piece>{{0, 4096, 4096}});
  // Two writes touching the same bytes use the same connection for them, whatever their start.
  for (uint64_t start : {uint64_t{0}, uint64_t{5000}, uint64_t{8192}}) {
    CAPTURE(start);
    const auto pieces = cut(7, start, 8200 - start, 4);  // every one covers [8192, 8200)
    CHECK(pieces.back().offset == 8192);
    CHECK(pieces.back().connection == (7 + 2) % 4);
  }
}

TEST_CASE("frame headers carry the fields and lengths the receiver checks") {
  const tcp::FrameHeader d = tcp::dataHeader(3, 4096, 100);
  CHECK(d.type == static_cast<uint8_t>(tcp::FrameType::kData));
  CHECK(d.regionId == 3);
  CHECK(d.offset == 4096);
  CHECK(d.length == 100);
  const tcp::FrameHeader f = tcp::flagHeader(3, 8, 42, 3);
  CHECK(f.length == 24);
  CHECK(f.value == 42);
  const tcp::FrameHeader m = tcp::messageHeader(5, 3);
  CHECK(m.length == 29);
  CHECK(m.value == 5);
  for (const auto& h : {d, f, m, tcp::heartbeatHeader(), tcp::goodbyeHeader()})
    CHECK_MESSAGE(tcp::checkHeader(h, 0, 3).empty(), tcp::checkHeader(h, 0, 3));

  const std::vector<uint64_t> counts{1, 0x0102030405060708ull};
  const auto payload = tcp::countsPayload(counts, bytesOf("hi"));
  REQUIRE(payload.size() == 18);
  CHECK(payload[0] == std::byte{1});
  CHECK(payload[8] == std::byte{0x08});  // little-endian
  CHECK(payload[15] == std::byte{0x01});
  CHECK(payload[16] == std::byte{'h'});
}

TEST_CASE("malformed frames are named precisely, and nothing malformed passes") {
  auto bad = [](tcp::FrameHeader h, uint32_t connection = 0) { return tcp::checkHeader(h, connection, 2); };
  tcp::FrameHeader h = tcp::heartbeatHeader();
  h.reserved[1] = 1;
  CHECK(bad(h) == "reserved header bytes set");
  h = tcp::heartbeatHeader();
  h.length = 1;
  CHECK(bad(h) == "heartbeat with a payload");
  CHECK(bad(tcp::dataHeader(1, 0, 0)) == "data frame of 0 bytes (limit 67108864)");
  CHECK(bad(tcp::dataHeader(1, 0, tcp::kMaxFramePayload + 1)) == "data frame of 67108865 bytes (limit 67108864)");
  CHECK(bad(tcp::dataHeader(1, 0, tcp::kMaxFramePayload)).empty());
  CHECK(bad(tcp::flagHeader(1, 0, 9, 3)) == "flag carries 24 bytes of counts, expected 16");
  CHECK(bad(tcp::messageHeader(4, 2), 1) == "control message on connection 1 (not 0)");
  h = tcp::messageHeader(4, 2);
  h.regionId = 1;
  CHECK(bad(h) == "control message with a region or offset");
  CHECK(bad(tcp::messageHeader(ControlChannel::kMaxMessageBytes + 1, 2)) ==
        "control message of 16777217 bytes (limit 16777216)");
  CHECK(bad(tcp::messageHeader(ControlChannel::kMaxMessageBytes, 2)).empty());
  h = tcp::messageHeader(4, 2);
  h.length += 1;
  CHECK(bad(h) == "control message frame of 21 bytes carries 4 message bytes and 2 connections' counts");
  h = tcp::heartbeatHeader();
  h.type = 9;
  CHECK(bad(h) == "unknown frame type 9");

  const tcp::FrameHeader d = tcp::dataHeader(4, 100, 28);
  CHECK(tcp::checkDataTarget(d, false, 0) == "write to region 4 which this node has not registered");
  CHECK(tcp::checkDataTarget(d, true, 127) == "write to [100, +28) of region 4 which has 127 bytes");
  CHECK(tcp::checkDataTarget(d, true, 128).empty());
  const tcp::FrameHeader f = tcp::flagHeader(4, 8, 1, 2);
  CHECK(tcp::checkFlagTarget(f, false, 0, 0) == "flag in region 4 which this node has not registered");
  CHECK(tcp::checkFlagTarget(f, true, 16, 0x1000).empty());
  CHECK(tcp::checkFlagTarget(f, true, 15, 0x1000) == "flag at offset 8 of region 4 (15 bytes) is misaligned or out of "
                                                    "bounds");
  CHECK_FALSE(tcp::checkFlagTarget(f, true, 16, 0x1004).empty());  // the address, not only the offset
  CHECK_FALSE(tcp::checkFlagTarget(tcp::flagHeader(4, 4, 1, 2), true, 16, 0x1000).empty());
}

// =========================================================================================================
// Peer state
// =========================================================================================================

TEST_CASE("a peer connects once every connection of the attempt is ready, in both directions") {
  tcp::PeerLifecycle p(2);
  CHECK(p.state() == PeerState::kConnecting);
  CHECK(p.acceptsHandshakes());
  CHECK_FALSE(p.connectionReady(true, 0).connected);
  CHECK_FALSE(p.connectionReady(true, 0).connected);
  CHECK_FALSE(p.connectionReady(false, 0).connected);
  CHECK(p.connectionReady(true, 1).superseded);  // a connection of an attempt that does not exist
  const auto r = p.connectionReady(false, 0);
  CHECK(r.connected);
  CHECK_FALSE(r.rejoined);
  CHECK(r.generation == 1);
  CHECK(p.state() == PeerState::kConnected);
  CHECK(p.generation() == 1);
  CHECK_FALSE(p.acceptsHandshakes());  // a stranger claiming this index is refused as a duplicate
}

TEST_CASE("a failed peer rejoins as a new incarnation, and nothing of an older attempt counts") {
  tcp::PeerLifecycle p(1);
  p.connectionReady(true, 0);
  p.connectionReady(false, 0);
  REQUIRE(p.state() == PeerState::kConnected);

  // Reports of an attempt that is not the current one are ignored.
  CHECK(p.fail(PeerState::kFailed, "stale", 5).ignored);
  auto f = p.fail(PeerState::kFailed, "inbound connection 0: connection reset by peer", 0);
  CHECK_FALSE(f.ignored);
  CHECK(f.first);
  CHECK(f.newAttempt == 1);
  CHECK(p.state() == PeerState::kFailed);
  CHECK(p.reason() == "inbound connection 0: connection reset by peer");
  // The other connections of the failed attempt report too: ignored, the reason stays the first.
  CHECK(p.fail(PeerState::kFailed, "outbound connection 0: EOF", 0).ignored);
  CHECK(p.fail(PeerState::kClosed, "goodbye", tcp::kAnyAttempt).ignored);
  CHECK_FALSE(p.acceptsHandshakes());  // until the rejoin starts

  CHECK_FALSE(p.beginRejoin(0));  // superseded
  REQUIRE(p.beginRejoin(1));
  CHECK(p.rejoining());
  CHECK(p.acceptsHandshakes());
  CHECK(p.connectionReady(true, 0).superseded);  // a late handshake of the old attempt

  // A rejoin attempt that breaks halfway starts another, quietly: the state and reason stay.
  p.connectionReady(true, 1);
  f = p.fail(PeerState::kFailed, "connecting to 10.0.0.2:7100: refused", 1);
  CHECK_FALSE(f.ignored);
  CHECK_FALSE(f.first);
  CHECK(f.newAttempt == 2);
  CHECK(p.reason() == "inbound connection 0: connection reset by peer");
  CHECK(p.lastDialError() == "connecting to 10.0.0.2:7100: refused");
  CHECK(p.outReady() == 0);
  REQUIRE(p.beginRejoin(2));

  // A handshake refusal while rejoining is retried quietly, never fatal.
  CHECK(p.handshakeFailure(ErrorCode::kPermissionDenied, "different secret") ==
        tcp::PeerLifecycle::HandshakeVerdict::kRetryQuietly);
  CHECK(p.fatalCode() == ErrorCode::kOk);
  CHECK(p.lastDialError() == "different secret");

  CHECK_FALSE(p.connectionReady(true, 2).connected);
  const auto r = p.connectionReady(false, 2);
  CHECK(r.connected);
  CHECK(r.rejoined);
  CHECK(r.generation == 2);
  CHECK(p.generation() == 2);
  CHECK(p.state() == PeerState::kConnected);
  CHECK(p.reason().empty());
  CHECK(p.lastDialError().empty());
  CHECK_FALSE(p.rejoining());
}

TEST_CASE("a handshake failure is fatal only while connect() runs, and never takes down a live peer") {
  tcp::PeerLifecycle p(1);
  CHECK(p.handshakeFailure(ErrorCode::kVersionMismatch, "version") == tcp::PeerLifecycle::HandshakeVerdict::kFail);
  CHECK(p.handshakeFailure(ErrorCode::kPermissionDenied, "secret") == tcp::PeerLifecycle::HandshakeVerdict::kFail);
  CHECK(p.fatalCode() == ErrorCode::kVersionMismatch);  // the first one is what connect() reports
  CHECK(p.fatal() == "version");

  tcp::PeerLifecycle live(1);
  live.connectionReady(true, 0);
  live.connectionReady(false, 0);
  CHECK(live.handshakeFailure(ErrorCode::kPermissionDenied, "stranger") ==
        tcp::PeerLifecycle::HandshakeVerdict::kIgnore);
  CHECK(live.state() == PeerState::kConnected);
}

TEST_CASE("flags and messages wait for the data queued before them, and leave in arrival order") {
  tcp::ArrivalOrder order(2);
  CHECK(order.ready() == nullptr);
  tcp::Arrival flag;
  flag.counts = {2, 1};
  flag.value = 7;
  order.push(flag);
  tcp::Arrival message;
  message.message = true;
  message.counts = {0, 0};  // needs nothing, but must not overtake the flag
  order.push(message);
  CHECK(order.ready() == nullptr);
  order.dataLanded(0);
  order.dataLanded(1);
  CHECK(order.ready() == nullptr);
  order.dataLanded(0);
  tcp::Arrival* a = order.ready();
  REQUIRE(a != nullptr);
  CHECK(a->value == 7);
  order.pop();
  a = order.ready();
  REQUIRE(a != nullptr);
  CHECK(a->message);
  order.pop();
  CHECK(order.ready() == nullptr);

  // A new attempt starts from nothing: counts of the old one do not release the new one's flags.
  order.push(flag);
  order.reset();
  CHECK(order.pending() == 0);
  order.push(flag);
  order.dataLanded(0);
  order.dataLanded(1);
  CHECK(order.ready() == nullptr);
}

TEST_CASE("a signalled op completes once every frame queued up to it is written, on every connection, in order") {
  tcp::CompletionTracker t;
  t.expect(10, {1, 0});
  t.expect(11, {1, 2});
  t.expect(12, {3, 2});
  std::vector<uint64_t> written{0, 0};
  auto writtenOn = [&](std::size_t c) { return written[c]; };
  std::vector<Completion> out;
  t.takeWritten(4, writtenOn, out);
  CHECK(out.empty());
  written = {1, 1};
  t.takeWritten(4, writtenOn, out);
  REQUIRE(out.size() == 1);
  CHECK(out[0].cookie == 10);
  CHECK(out[0].peer == 4);
  CHECK(out[0].code == ErrorCode::kOk);
  written = {5, 1};  // op 12's connection 0 is done, but op 11 is not: nothing overtakes it
  t.takeWritten(4, writtenOn, out);
  CHECK(out.size() == 1);
  written = {5, 2};
  t.takeWritten(4, writtenOn, out);
  REQUIRE(out.size() == 3);
  CHECK(out[1].cookie == 11);
  CHECK(out[2].cookie == 12);
  CHECK(t.pending() == 0);

  t.expect(13, {9, 9});
  t.expect(14, {9, 9});
  out.clear();
  t.failAll(4, out);
  REQUIRE(out.size() == 2);
  CHECK(out[0].code == ErrorCode::kPeerLost);
  CHECK(out[1].cookie == 14);
  CHECK(t.pending() == 0);
}
