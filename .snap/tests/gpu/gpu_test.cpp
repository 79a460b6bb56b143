// The cuda backend end to end: discovery, memory, registration, AllGather in both executors, and failures.
// Every rank is a forked child (this process never initialises CUDA); the daemon is a real tandemd.
// Under MPS (an MPS control pipe is present) the daemon-executor cases run and the kill cases skip, and the other way
// round without MPS: killing an MPS client mid-kernel poisons the MPS server for every process on that GPU. A case
// that skips says so (skip.hpp); CTest runs each of the two sets as an entry of its own (CMakeLists.txt).
#include <algorithm>
#include <random>
#include <sstream>

#include "gpu_harness.hpp"
#include "session.hpp"
#include "tandem/common/gpu_uuid.hpp"

using namespace tandem::gputest;

namespace {

// Deterministic bytes for (rank, size, iteration).
void fill(std::vector<unsigned char>& out, uint64_t bytes, uint32_t rank, uint32_t iter) {
  out.resize(bytes);
  uint64_t x = 0x9E3779B97F4A7C15ull ^ (bytes * 1315423911ull) ^ (uint64_t{rank} << 40) ^ (uint64_t{iter} << 56);
  uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&out[i], &x, 8);
  }
  for (; i < bytes; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    out[i] = static_cast<unsigned char>(x);
  }
}


// One rank of a series of AllGathers; verifies every byte of recv. Buffers: tandem_alloc, or cudaMalloc
// registered with tandem_register (useRegister), at misaligned offsets on odd iterations.
std::string allgatherRank(const std::string& socket, const tandem_unique_id_t& id, uint32_t nranks, uint32_t rank,
                          int device, const std::vector<uint64_t>& sizes, bool useRegister) {
  CK(cudaSetDevice(device));
  tandem_session_t s;
  TK(tandem_connect(socket.c_str(), &s));
  tandem_comm_t comm;
  TK(tandem_comm_init(s, &id, nranks, rank, 60000, &comm));
  const uint64_t maxS = *std::max_element(sizes.begin(), sizes.end());
  const uint64_t sendBytes = maxS + 64, recvBytes = nranks * maxS + 64;
  tandem_buffer_t send, recv;
  void* rawSend = nullptr;
  void* rawRecv = nullptr;
  if (useRegister) {
    CK(cudaMalloc(&rawSend, sendBytes));
    CK(cudaMalloc(&rawRecv, recvBytes));
    TK(tandem_register(s, rawSend, sendBytes, -1, 0, &send));
    TK(tandem_register(s, rawRecv, recvBytes, -1, 0, &recv));
  } else {
    TK(tandem_alloc(s, sendBytes, &send));
    TK(tandem_alloc(s, recvBytes, &recv));
  }
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<unsigned char> data, expect, got;
  for (uint64_t S : sizes) {
    const uint32_t iters = S >= (512u << 20) ? 1 : 2;
    for (uint32_t it = 0; it < iters; ++it) {
      const uint64_t sendOff = it == 1 ? 3 : 0, recvOff = it == 1 ? 5 : 0;
      fill(data, S, rank, it);
      auto* sp = static_cast<char*>(tandem_buffer_ptr(send));
      auto* rp = static_cast<char*>(tandem_buffer_ptr(recv));
      // On the op's stream: `stream` does not synchronise with the legacy default stream, so a plain cudaMemset (or
      // a pageable cudaMemcpy, whose DMA may still run after it returns) could land after the op had written recv.
      CK(cudaMemcpyAsync(sp + sendOff, data.data(), S, cudaMemcpyHostToDevice, stream));
      CK(cudaMemsetAsync(rp, 0xCD, recvBytes, stream));
      tandem_op_t op;
      const tandem_allgather_args_t args{sizeof args, {send, sendOff}, {recv, recvOff}, S, stream};
      TK(tandem_allgather(comm, &args, &op));
      const std::string synced = syncWithin(stream, 60000);
      if (synced != "synced") return fmt::format("FAIL size {} iter {}: stream {}", S, it, synced);
      if (tandem_wait(op, 60000) != TANDEM_SUCCESS) {
        return fmt::format("FAIL size {} iter {}: op failed: {}", S, it, tandem_last_error());
      }
      got.resize(nranks * S);
      CK(cudaMemcpy(got.data(), rp + recvOff, nranks * S, cudaMemcpyDeviceToHost));
      for (uint32_t q = 0; q < nranks; ++q) {
        fill(expect, S, q, it);
        if (std::memcmp(got.data() + q * S, expect.data(), S) != 0) {
          uint64_t first = 0;
          while (got[q * S + first] == expect[first]) ++first;
          return fmt::format("FAIL size {} iter {}: rank {}'s shard differs first at byte {} (got {:#x}, want {:#x})", S,
                             it, q, first, got[q * S + first], expect[first]);
        }
      }
      // Nothing outside [recvOff, recvOff + n*S) was written.
      unsigned char edge[2];
      CK(cudaMemcpy(edge, rp + recvOff + nranks * S, 1, cudaMemcpyDeviceToHost));
      if (recvOff > 0) CK(cudaMemcpy(edge + 1, rp + recvOff - 1, 1, cudaMemcpyDeviceToHost));
      if (edge[0] != 0xCD || (recvOff > 0 && edge[1] != 0xCD)) {
        return fmt::format("FAIL size {} iter {}: bytes outside recv were written", S, it);
      }
    }
  }
  if (useRegister) {
    TK(tandem_deregister(send));
    TK(tandem_deregister(recv));
    CK(cudaFree(rawSend));
    CK(cudaFree(rawRecv));
  } else {
    TK(tandem_free(send));
    TK(tandem_free(recv));
  }
  TK(tandem_comm_destroy(comm));
  tandem_disconnect(s);
  return "OK";
}

// TANDEM_GPU_TEST_MAX_BYTES caps the sizes (a quick run); the default reaches 1 GiB.
std::vector<uint64_t> testSizes() {
  std::mt19937_64 rng(20261129);
  std::vector<uint64_t> sizes = {1, 5, 4096, 65536 + 7, 1u << 20};
  sizes.push_back(1 + rng() % (64u << 20));
  sizes.push_back((256u << 20) + 13);
  sizes.push_back(uint64_t{1} << 30);
  const char* cap = std::getenv("TANDEM_GPU_TEST_MAX_BYTES");
  if (cap != nullptr && *cap != '\0') {
    const uint64_t c = std::strtoull(cap, nullptr, 0);
    std::erase_if(sizes, [&](uint64_t s) { return s > c; });
  }
  return sizes;
}

void runAllGather(const Daemon& d, uint32_t nranks, bool useRegister, const std::vector<uint64_t>& sizes) {
  tandem_unique_id_t id;
  REQUIRE(tandem_get_unique_id(&id) == TANDEM_SUCCESS);
  std::vector<Rank> ranks;
  for (uint32_t r = 0; r < nranks; ++r) {
    const int device = rankDevice(r);
    ranks.push_back(spawn([&, r, device](const Io&) {
      return allgatherRank(d.socket(), id, nranks, r, device, sizes, useRegister);
    }));
  }
  for (uint32_t r = 0; r < nranks; ++r) {
    const std::string result = ranks[r].read(300000);
    INFO("rank " << r << ": " << result);
    INFO(d.log());
    CHECK(result == "OK");
  }
  for (auto& r : ranks) r.reap();
}

}  // namespace

TEST_CASE("discovery: status lists every GPU by UUID with SMs, memory and NVLink peers") {
  Daemon d(config("client"), {}, "");
  const json st = status(d);
  INFO(st.dump(2));
  CHECK(st["backend"] == "cuda");
  CHECK(st["executor"] == "client");
  REQUIRE(st["gpus"].size() == static_cast<size_t>(gpuCount()));
  for (const auto& g : st["gpus"]) {
    CHECK(g["uuid"].get<std::string>().rfind("GPU-", 0) == 0);
    CHECK(g["sms"].get<int>() > 0);
    CHECK(g["memory_bytes"].get<uint64_t>() > (uint64_t{1} << 30));
    CHECK(g["peers"].size() == static_cast<size_t>(gpuCount() - 1));
    for (const auto& p : g["peers"]) CHECK(p["p2p"] == true);
  }
  MESSAGE("tandemctl status:\n" << d.ctl({"status"}));

  // cuda.devices restricts the set to the UUIDs listed.
  const std::string first = st["gpus"][0]["uuid"];
  Daemon one("daemon:\n  backend: cuda\n  executor: client\nplans:\n  state_dir: " + processPlanDir() +
                 "\ncuda:\n  devices: [\"" + first + "\"]\n",
             {}, "");
  const json st1 = status(one);
  REQUIRE(st1["gpus"].size() == 1);
  CHECK(st1["gpus"][0]["uuid"] == first);
}

TEST_CASE("backend cuda without a usable GPU exits 69 and says why") {
  TempDir dir;
  const std::string sock = (dir.path() / "t.sock").string();
  CommandResult r = runCommand({"/usr/bin/env", "CUDA_VISIBLE_DEVICES=", TANDEMD_PATH, "--foreground", "--backend",
                                "cuda", "--socket", sock}, 30000);
  INFO(r.out << r.err);
  CHECK(r.exitCode == 69);
  CHECK((r.err + r.out).find("no CUDA device is usable") != std::string::npos);

  const std::string cfg = (dir.path() / "c.yaml").string();
  std::ofstream(cfg) << "daemon:\n  backend: cuda\ncuda:\n  devices: [\"GPU-00000000-0000-0000-0000-000000000000\"]\n";
  r = runCommand({TANDEMD_PATH, "--foreground", "--config", cfg, "--socket", sock}, 30000);
  INFO(r.out << r.err);
  CHECK(r.exitCode == 69);
  CHECK((r.err + r.out).find("is not visible") != std::string::npos);
}

TEST_CASE("executor daemon needs MPS: refused with how to start it" * doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps("the refusal happens only without MPS")) return;
  TempDir dir;
  const std::string cfg = (dir.path() / "c.yaml").string();
  std::ofstream(cfg) << config("daemon");
  const CommandResult r =
      runCommand({TANDEMD_PATH, "--foreground", "--config", cfg, "--socket", (dir.path() / "t.sock").string()}, 30000);
  INFO(r.out << r.err);
  CHECK(r.exitCode == 69);
  CHECK((r.err + r.out).find("nvidia-cuda-mps-control -d") != std::string::npos);
}

TEST_CASE("memory: device allocations, registrations cached and released, every byte accounted") {
  Daemon d(config("client"), {}, "");
  Rank rank = spawn([&](const Io& io) -> std::string {
    CK(cudaSetDevice(0));
    tandem_session_t s;
    TK(tandem_connect(d.socket().c_str(), &s));
    if (std::string(tandem_session_backend(s)) != "cuda") return "FAIL backend is not cuda";
    tandem_buffer_t b;
    TK(tandem_alloc(s, 3'000'000, &b));
    cudaPointerAttributes attr{};
    CK(cudaPointerGetAttributes(&attr, tandem_buffer_ptr(b)));
    if (attr.type != cudaMemoryTypeDevice) return "FAIL tandem_buffer_ptr is not device memory";
    std::vector<int> in(750'000), out(750'000);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<int>(i * 7 + 1);
    CK(cudaMemcpy(tandem_buffer_ptr(b), in.data(), 3'000'000, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(out.data(), tandem_buffer_ptr(b), 3'000'000, cudaMemcpyDeviceToHost));
    if (in != out) return "FAIL round trip through the buffer";
    void* raw = nullptr;
    CK(cudaMalloc(&raw, 1u << 20));
    tandem_buffer_t r1, r2, r3;
    TK(tandem_register(s, raw, 1u << 20, -1, 0, &r1));
    TK(tandem_register(s, raw, 1u << 20, -1, 0, &r2));
    TK(tandem_register(s, static_cast<char*>(raw) + 4096, 4096, -1, 0, &r3));
    if (r1 != r2) return "FAIL the same range registered twice gave two buffers";
    if (r3 == r1) return "FAIL a different range gave the same buffer";
    io.say("allocated");
    if (io.hear() != "next") return "FAIL parent";
    TK(tandem_deregister(r1));
    TK(tandem_deregister(r2));
    TK(tandem_deregister(r3));
    // Host memory is refused with a message.
    std::vector<char> host(4096);
    tandem_buffer_t bad;
    if (tandem_register(s, host.data(), host.size(), -1, 0, &bad) != TANDEM_ERROR_INVALID_ARGUMENT) {
      return "FAIL host memory was accepted";
    }
    io.say("deregistered");
    if (io.hear() != "next") return "FAIL parent";
    TK(tandem_free(b));
    CK(cudaFree(raw));
    tandem_disconnect(s);
    return "OK";
  });
  REQUIRE(rank.read(60000) == "allocated");
  json st = status(d);
  // 3 MB rounds up to the 2 MiB granularity (4 MiB); the registrations are 1 MiB + 4 KiB.
  CHECK(st["total_buffers"] == 3);
  CHECK(st["total_bytes"] == (4u << 20) + (1u << 20) + 4096);
  rank.tell("next");
  REQUIRE(rank.read(60000) == "deregistered");
  CHECK(status(d)["total_buffers"] == 1);
  rank.tell("next");
  CHECK(rank.read(60000) == "OK");
  rank.reap();
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("bad buffer handles are refused and change nothing") {
  Daemon d(config("client"), {}, "");
  Rank rank = spawn([&](const Io&) -> std::string {
    CK(cudaSetDevice(0));
    auto session = tandem::client::Session::connect(d.socket());
    // A garbage legacy IPC handle.
    tandem::v1::Request reg;
    reg.mutable_register_buffer()->set_kind(tandem::v1::REGISTER_KIND_CUDA_IPC);
    reg.mutable_register_buffer()->set_bytes(4096);
    reg.mutable_register_buffer()->set_ipc_handle(std::string(64, '\x5a'));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, 0));
    const std::string uuid = tandem::formatGpuUuid(prop.uuid.bytes);
    reg.mutable_register_buffer()->set_device_uuid(uuid);
    try {
      session->call(reg);
      return "FAIL a garbage IPC handle was accepted";
    } catch (const tandem::Error& e) {
      if (e.code() != tandem::ErrorCode::kInvalidArgument) return std::string("FAIL ipc: ") + e.what();
    }
    // A memfd passed as a cuMem fd.
    tandem::Fd memfd = tandem::Fd::memfd("not-cumem", 1u << 21);
    tandem::v1::Request reg2;
    reg2.mutable_register_buffer()->set_kind(tandem::v1::REGISTER_KIND_CUDA_FD);
    reg2.mutable_register_buffer()->set_bytes(4096);
    const int fds[] = {memfd.get()};
    try {
      session->call(reg2, fds);
      return "FAIL a memfd was accepted as cuMem memory";
    } catch (const tandem::Error& e) {
      if (e.code() != tandem::ErrorCode::kInvalidArgument) return std::string("FAIL fd: ") + e.what();
    }
    // A descriptor naming a buffer this session does not own: rejected, and the stream gate opens with a
    // "skip" verdict (the client executor's kernel would not run).
    tandem_unique_id_t id;
    tandem_get_unique_id(&id);
    tandem::v1::Request join;
    join.mutable_join_comm()->set_unique_id(std::string(reinterpret_cast<const char*>(id.bytes), 16));
    join.mutable_join_comm()->set_nranks(1);
    join.mutable_join_comm()->set_rank(0);
    join.mutable_join_comm()->set_device_uuid(uuid);
    std::vector<tandem::Fd> ctlFd;
    const auto joined = session->call(join, {}, &ctlFd, 1);
    tandem::OpDescriptor desc{};
    desc.version = tandem::kDescriptorVersion;
    desc.kind = tandem::OpKind::kAllGather;
    desc.nranks = 1;
    desc.commHandle = joined.join_comm().comm_handle();
    desc.dims[0] = 4096;
    desc.bufs[0] = {12345, 0, 4096};
    desc.bufs[1] = {12346, 0, 4096};
    const auto result = session->wait(session->submit(desc), 10000);
    if (result.code != tandem::ErrorCode::kInvalidArgument) return "FAIL bad buffer id: " + result.message;
    tandem::Mapping ctl = tandem::Mapping::shared(ctlFd[0].get(), tandem::kernels::kControlBytes);
    const auto* c = reinterpret_cast<const tandem::kernels::CommControl*>(ctl.data());
    // The completion is posted just before the gate opens: give the daemon a moment.
    eventually([&] { return std::atomic_ref<const uint32_t>(c->go.value).load() == 1; }, 2000);
    if (c->go.value != 1 || c->verdict[1] != (1 | tandem::kernels::kVerdictRejected)) {
      return fmt::format("FAIL go {} verdict {:#x}", c->go.value, c->verdict[1]);
    }
    return "OK " + result.message;
  });
  const std::string out = rank.read(60000);
  INFO(out);
  CHECK(out.rfind("OK", 0) == 0);
  rank.reap();
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("allgather, client executor: bitwise exact at 1 and 2 ranks, 1 B .. 1 GiB") {
  Daemon d(config("client"), {}, "");
  const auto sizes = testSizes();
  MESSAGE("MPS " << std::string(mpsRunning() ? "on" : "off") << "; sizes: " << [&] {
    std::ostringstream o;
    for (auto s : sizes) o << s << " ";
    return o.str();
  }());
  SUBCASE("1 rank, tandem_alloc buffers") { runAllGather(d, 1, false, sizes); }
  SUBCASE("2 ranks, tandem_alloc buffers") { runAllGather(d, 2, false, sizes); }
  SUBCASE("2 ranks, registered cudaMalloc buffers") {
    runAllGather(d, 2, true, {1, 4096 + 3, 3u << 20, (64u << 20) + 1});
  }
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0; }));
}

TEST_CASE("allgather, daemon executor (MPS): bitwise exact at 1 and 2 ranks, 1 B .. 1 GiB" *
          doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  Daemon d(config("daemon"), {}, "");
  REQUIRE(status(d)["executor"] == "daemon");
  const auto sizes = testSizes();
  SUBCASE("1 rank") { runAllGather(d, 1, false, sizes); }
  const uint32_t n = ranksFor("daemon", 2);
  MESSAGE(n << " rank(s) at most: one per GPU");
  SUBCASE("2 ranks") { runAllGather(d, n, false, sizes); }
  SUBCASE("2 ranks, registered cudaMalloc buffers") { runAllGather(d, n, true, {7, 1u << 20, (32u << 20) + 5}); }
  // After the linger the kernel has exited; the next op relaunches it.
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  SUBCASE("after the persistent kernel exited") { runAllGather(d, n, false, {4096, 8u << 20}); }
}

TEST_CASE("a client SIGKILLed mid-op (client executor, no MPS) leaves the daemon healthy" *
          doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  Daemon d(config("client"), {}, "");
  tandem_unique_id_t id;
  tandem_get_unique_id(&id);
  // The survivor's stream is gated, so the victim's kernel runs, waiting for the survivor's chunks.
  Rank survivor = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 0, true); });
  Rank victim = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 1, false); });
  expectStreamReleasedAfterKill(survivor, victim, true, [&] { return d.log(); });
  // Healthy: status answers, everything was reclaimed, and a new communicator works on both GPUs.
  CHECK(eventually([&] { return status(d)["total_bytes"] == 0 && status(d)["communicators"].empty(); }, 10000));
  runAllGather(d, 2, false, {4096, 16u << 20});
}

TEST_CASE("a killed daemon leaves no client stream hanging" * doctest::test_suite(kNeedsNoMps)) {
  if (skipUnderMps()) return;
  auto d = std::make_unique<Daemon>(config("client"), std::vector<std::string>{}, "");
  tandem_unique_id_t id;
  tandem_get_unique_id(&id);
  // Rank 1's stream is gated: rank 0's kernel runs and waits for rank 1's chunks when the daemon dies.
  Rank running = spawn([&](const Io& io) { return gatedRank(io, d->socket(), id, 0, false); });
  Rank gated = spawn([&](const Io& io) { return gatedRank(io, d->socket(), id, 1, true); });
  REQUIRE(running.read(60000) == "submitted");
  REQUIRE(gated.read(60000) == "submitted");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto killedAt = Clock::now();
  d->signal(SIGKILL);
  running.tell("sync");
  const std::string r0 = running.read(15000);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - killedAt).count();
  INFO(r0);
  INFO(d->log());
  CHECK(r0.rfind("synced ", 0) == 0);
  CHECK(r0.find(" " + std::to_string(TANDEM_ERROR_DAEMON_LOST) + " ") != std::string::npos);
  CHECK(ms < 5000);
  // The gated rank's kernel starts after the daemon died: it sees the abort and its stream drains too.
  gated.tell("release");
  gated.tell("sync");
  const std::string r1 = gated.read(15000);
  INFO(r1);
  CHECK(r1.rfind("synced ", 0) == 0);
  running.reap();
  gated.reap();
}

TEST_CASE("a barrier holds a stream until every rank's stream reaches it (client executor)") {
  Daemon d(config("client"), {}, "");
  tandem_unique_id_t id;
  tandem_get_unique_id(&id);
  Rank early = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 0, false, GatedOp::kBarrier); });
  Rank late = spawn([&](const Io& io) { return gatedRank(io, d.socket(), id, 1, true, GatedOp::kBarrier); });
  REQUIRE(early.read(60000) == "submitted");
  REQUIRE(late.read(60000) == "submitted");
  // Rank 1's stream has not reached the barrier: rank 0's must still be inside it.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  early.tell("poll");
  CHECK(early.read(10000) == "running");
  late.tell("release");
  late.tell("sync");
  early.tell("sync");
  const std::string r1 = late.read(30000), r0 = early.read(30000);
  INFO(r0 << " / " << r1 << "\n" << d.log());
  CHECK(r0.rfind("synced 0", 0) == 0);
  CHECK(r1.rfind("synced 0", 0) == 0);
  early.reap();
  late.reap();
}

namespace {

// 200 stream barriers then a host barrier at 2 ranks (one per GPU for the daemon executor).
void runBarrierInStreamOrder(const std::string& ex) {
  Daemon d(config(ex), {}, "");
  tandem_unique_id_t id;
  tandem_get_unique_id(&id);
  std::vector<Rank> ranks;
  const uint32_t n = ranksFor(ex, 2);
  for (uint32_t r = 0; r < n; ++r) {
    ranks.push_back(spawn([&, r](const Io&) -> std::string {
      CK(cudaSetDevice(rankDevice(r)));
      tandem_session_t s;
      TK(tandem_connect(d.socket().c_str(), &s));
      tandem_comm_t comm;
      TK(tandem_comm_init(s, &id, n, r, 60000, &comm));
      cudaStream_t stream;
      CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      tandem_op_t op{};
      const tandem_barrier_args_t barrierArgs{sizeof barrierArgs, stream};
      for (int i = 0; i < 200; ++i) TK(tandem_barrier_stream(comm, &barrierArgs, &op));
      const std::string synced = syncWithin(stream, 30000);
      if (synced != "synced") return "FAIL stream " + synced;
      if (tandem_wait(op, 10000) != TANDEM_SUCCESS) return std::string("FAIL ") + tandem_last_error();
      TK(tandem_barrier(comm, &op));  // the legacy default stream
      CK(cudaDeviceSynchronize());
      if (tandem_wait(op, 10000) != TANDEM_SUCCESS) return std::string("FAIL ") + tandem_last_error();
      tandem_comm_destroy(comm);
      tandem_disconnect(s);
      return "OK";
    }));
  }
  for (auto& r : ranks) {
    const std::string out = r.read(60000);
    INFO(out);
    INFO(d.log());
    CHECK(out == "OK");
    r.reap();
  }
}

}  // namespace

TEST_CASE("barrier in stream order, client executor") { runBarrierInStreamOrder("client"); }

TEST_CASE("barrier in stream order, daemon executor (MPS)" * doctest::test_suite(kNeedsMps)) {
  if (skipWithoutMps()) return;
  runBarrierInStreamOrder("daemon");
}
