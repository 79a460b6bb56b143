// A userspace test double of the part of libibverbs that tandem calls, for machines without an RDMA NIC (this one,
// CI, the GPU hosts: no rxe or siw in their kernels either). It is a stand-in for checking tandem's USE of verbs
// (QP state machine, ordering, completions, error paths), never a measure of speed.
//
// Model: one "HCA" per process (created by the first ibv_open_device), one RoCE port (link layer Ethernet, so
// every path needs a GRH), one GID that names the process (fe80::5444:424c:<pid>). The HCA listens on a unix socket
// $TANDEM_VERBS_DOUBLE_DIR/tdbl-<pid>.sock (default /tmp; filesystem sockets reach across network namespaces).
// An RC QP that reaches RTS dials its destination's HCA (from the dgid of its RTR address vector) and runs a small
// reliable-connection protocol on that stream: the requester sends each work request as one packet, the responder
// validates it (rkey, bounds, MR and QP access flags, PD, state), places the data, and answers ACK, NAK or, for a
// destination that is gone or not connected to this QP, DROP. Packets of one QP are executed in order and each is
// placed before the next is looked at, so an RDMA WRITE posted after others lands after them, and a receive
// completion (SEND, WRITE_WITH_IMM) is generated only after the data of every earlier packet of the QP is in
// memory: the ordering a real HCA gives for host memory. Data is read from the source at transmit time, as DMA is.
//
// Checks a real HCA (or libibverbs) makes, made here too: modify_qp takes exactly the required and optional
// attribute masks of each RC transition (IBTA 11.2.4.1, table 91) and checks their values against the device's
// limits; post_send needs RTS; the send queue holds at most max_send_wr WQEs until a polled completion retires them
// (unsignalled WQEs retire with the next signalled one, as providers do); inline data is bounded by max_inline_data;
// SGEs must lie inside an MR of the QP's PD; remote access needs the MR's and the QP's access flags; a SEND or
// WRITE_WITH_IMM that finds no posted receive waits for one (RNR retry 7); errors move the QP to the error state and
// flush every outstanding work request with IBV_WC_WR_FLUSH_ERR; destroy calls refuse (EBUSY) while children live.
//
// What differs, on purpose: a responder that is gone is reported at once (IBV_WC_RETRY_EXC_ERR) instead of after
// timeout x retry_cnt; post_send before RTS fails with EINVAL (real providers queue the WQE and never execute it);
// no completion channels, SRQs, UD/UC, atomics or memory windows (tandem uses none). ibv_reg_dmabuf_mr maps the fd
// (tests pass a memfd for the GPU memory a real dma-buf would name); a CUDA dma-buf, which cannot be mapped, is
// reached through its iova instead.
//
// GPU memory (namespace gpu below): in a process that has loaded libcuda, an MR over CUDA device memory (ibv_reg_mr
// on a device pointer, as nvidia-peermem allows, or a CUDA dma-buf) is a device MR. Every byte the double moves in or
// out of one (RDMA WRITE and SEND sources, WRITE and WRITE_WITH_IMM targets, receive buffers, both ends of an RDMA
// READ) goes through a synchronous driver copy, so a packet's bytes are in GPU memory before the next packet of any
// QP is looked at (and before its ACK): an 8-byte flag written after the data lands after it, for a GPU that polls the
// flag. A failed copy fails the work request (IBV_WC_LOC_QP_OP_ERR locally, IBV_WC_REM_OP_ERR at the responder) and
// moves the QP to the error state, as a DMA fault on a real HCA would, with a line on stderr. Without libcuda every
// MR is host memory, as before.
//
// Threads: the verbs calls and the HCA's service thread share one mutex; every socket is non-blocking. The GPU copies
// run on the service thread with the mutex held (the verbs calls wait for them).
#include <infiniband/verbs.h>

// The header turns these into inline wrappers; the library exports the functions themselves.
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "verbs_double_control.h"

namespace {

using Clock = std::chrono::steady_clock;

// Device limits the double reports (and enforces). Round numbers of the order of a ConnectX-7's.
constexpr int kMaxQpWr = 32768;
constexpr int kMaxSge = 30;
constexpr int kMaxCqe = 4194303;
constexpr int kMaxQpRdAtom = 16;
constexpr uint32_t kMaxInline = 256;
constexpr uint32_t kMaxMsgBytes = 1u << 31;
constexpr int kGidTableLen = 4;  // index 0 holds the process's GID; the rest are empty, as on a port without IPs
constexpr ibv_mtu kActiveMtu = IBV_MTU_4096;
constexpr uint32_t k24Bits = 0xffffff;
constexpr size_t kMaxQueuedOutBytes = 4u << 20;  // a connection gathers no more WQEs while this much is unsent

// ---- wire protocol between two HCAs (one stream per requester QP) ----
enum PacketType : uint32_t {
  kHello = 1,      // requester -> responder: a = source QPN, b = destination QPN, addr = source pid
  kWrite = 2,      // addr, rkey, len, then len bytes
  kWriteImm = 3,   // as kWrite, imm
  kSend = 4,       // len bytes, imm when b = 1
  kReadReq = 5,    // addr, rkey, len
  kAck = 16,       // seq
  kNak = 17,       // seq, a = the ibv_wc_status the requester reports
  kReadResp = 18,  // seq, len bytes
  kDrop = 19,      // the destination QP does not exist, is not connected to the source, or is in error
};
struct Packet {
  uint32_t type = 0;
  uint32_t len = 0;
  uint64_t seq = 0;
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint32_t imm = 0;
  uint32_t a = 0;
  uint32_t b = 0;
};
static_assert(sizeof(Packet) == 40);

struct Faults {
  uint64_t delayCompletionsMs = 0;
  uint64_t qpErrorAfterWrites = 0;
  uint64_t vanishAfterWrites = 0;
};

bool parseFaults(const char* spec, Faults& out) {
  Faults f;
  std::string s = spec ? spec : "";
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return false;
    const std::string key = item.substr(0, eq);
    char* tail = nullptr;
    const unsigned long long v = std::strtoull(item.c_str() + eq + 1, &tail, 10);
    if (tail == item.c_str() + eq + 1 || *tail != '\0') return false;
    if (key == "delay_completions_ms") f.delayCompletionsMs = v;
    else if (key == "qp_error_after_writes") f.qpErrorAfterWrites = v;
    else if (key == "vanish_after_writes") f.vanishAfterWrites = v;
    else return false;
  }
  out = f;
  return true;
}

// ---- GPU memory: the CUDA driver API, reached through dlopen (the double never links CUDA) ----
//
// An MR over CUDA device memory is recognised at registration: ibv_reg_mr on a device pointer (as nvidia-peermem
// lets real HCAs do) or ibv_reg_dmabuf_mr of an fd it cannot map (a CUDA dma-buf refuses mmap) whose iova is one
// (the double runs in the registrant's process, so it takes iova for the CUDA VA of the dma-buf's bytes). Only a
// process that has loaded libcuda can hold a device pointer, so the double looks for an already loaded libcuda.so.1
// (RTLD_NOLOAD) at each registration until it finds one: without it (CI, the CPU backend) every address is host
// memory, as before. Data moves between such an MR and the wire with cuMemcpyDtoHAsync / cuMemcpyHtoDAsync on a
// non-blocking stream of the pointer's device's primary context, each followed by cuStreamSynchronize, on the
// double's service thread: a copy engine does the "DMA", next to kernels that may be spinning on the same memory
// (a non-blocking stream never waits for them; the legacy stream would).
namespace gpu {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUdevice = int;
using CUcontext = void*;
using CUstream = void*;
constexpr CUresult kSuccess = 0;
constexpr int kAttrMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttrIsManaged = 8;      // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr int kAttrDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;  // CU_MEMORYTYPE_DEVICE
constexpr unsigned kStreamNonBlocking = 1;  // CU_STREAM_NON_BLOCKING

// The driver entry points the double uses (the _v2 names are what cuda.h maps the plain ones to).
struct Driver {
  CUresult (*getErrorName)(CUresult, const char**) = nullptr;
  CUresult (*getErrorString)(CUresult, const char**) = nullptr;
  CUresult (*pointerGetAttribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*memGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*deviceGet)(CUdevice*, int) = nullptr;
  CUresult (*primaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*ctxSetCurrent)(CUcontext) = nullptr;
  CUresult (*streamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*streamSynchronize)(CUstream) = nullptr;
  CUresult (*memcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*memcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
};

// Guarded by the Hca's mutex (registration and every copy hold it).
struct State {
  void* lib = nullptr;
  Driver d;
  std::string missing;                          // a symbol libcuda lacks: device memory stays unknown
  std::unordered_map<int, CUcontext> contexts;  // device ordinal -> its primary context, retained for good
  std::unordered_map<CUcontext, CUstream> streams;  // the service thread's copy stream per context
};
State& state() {
  static State* s = new State;  // leaked, as the Hca
  return *s;
}

template <typename Fn>
bool bind(void* lib, const char* name, Fn*& out, std::string& missing) {
  out = reinterpret_cast<Fn*>(::dlsym(lib, name));
  if (out == nullptr && missing.empty()) missing = name;
  return out != nullptr;
}

// The driver, if this process has loaded it (and it has every entry point); null otherwise.
const Driver* driver() {
  State& s = state();
  if (s.lib != nullptr) return s.missing.empty() ? &s.d : nullptr;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return nullptr;  // not loaded (yet): looked for again at the next registration
  s.lib = lib;
  Driver& d = s.d;
  bind(lib, "cuGetErrorName", d.getErrorName, s.missing);
  bind(lib, "cuGetErrorString", d.getErrorString, s.missing);
  bind(lib, "cuPointerGetAttribute", d.pointerGetAttribute, s.missing);
  bind(lib, "cuMemGetAddressRange_v2", d.memGetAddressRange, s.missing);
  bind(lib, "cuDeviceGet", d.deviceGet, s.missing);
  bind(lib, "cuDevicePrimaryCtxRetain", d.primaryCtxRetain, s.missing);
  bind(lib, "cuCtxSetCurrent", d.ctxSetCurrent, s.missing);
  bind(lib, "cuStreamCreate", d.streamCreate, s.missing);
  bind(lib, "cuStreamSynchronize", d.streamSynchronize, s.missing);
  bind(lib, "cuMemcpyHtoDAsync_v2", d.memcpyHtoDAsync, s.missing);
  bind(lib, "cuMemcpyDtoHAsync_v2", d.memcpyDtoHAsync, s.missing);
  if (!s.missing.empty()) {
    std::fprintf(stderr, "verbs double: libcuda.so.1 is loaded but has no %s; GPU memory is not modelled (device "
                         "pointers are taken for host memory)\n", s.missing.c_str());
    return nullptr;
  }
  return &d;
}

std::string describe(CUresult r) {
  const Driver* d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d != nullptr) {
    d->getErrorName(r, &name);
    d->getErrorString(r, &text);
  }
  std::string out = std::string(name ? name : "CUDA error") + " " + std::to_string(r);
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

// Where an MR's bytes are when they are GPU memory.
struct Memory {
  int ordinal = -1;
  CUcontext ctx = nullptr;
};

enum class Probe { kHost, kDevice, kBad };

// Whether [addr, addr + len) is CUDA device memory of this process. kBad (with `why`): it is, but not usable
// (the range leaves its allocation, its context cannot be retained).
Probe probe(uint64_t addr, uint64_t len, Memory& out, std::string& why) {
  const Driver* d = driver();
  if (d == nullptr || addr == 0) return Probe::kHost;
  unsigned type = 0;
  if (d->pointerGetAttribute(&type, kAttrMemoryType, addr) != kSuccess) return Probe::kHost;  // not CUDA's
  if (type != kMemoryTypeDevice) return Probe::kHost;  // pinned (mapped) host memory: the CPU reaches it
  int managed = 0;
  if (d->pointerGetAttribute(&managed, kAttrIsManaged, addr) == kSuccess && managed != 0) return Probe::kHost;
  int ordinal = -1;
  if (CUresult r = d->pointerGetAttribute(&ordinal, kAttrDeviceOrdinal, addr); r != kSuccess) {
    why = "cuPointerGetAttribute(DEVICE_ORDINAL) -> " + describe(r);
    return Probe::kBad;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (CUresult r = d->memGetAddressRange(&base, &size, addr); r != kSuccess) {
    why = "cuMemGetAddressRange -> " + describe(r);
    return Probe::kBad;
  }
  if (len > size || addr - base > size - len) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "[0x%llx, +%llu) leaves its allocation [0x%llx, +%zu) on GPU %d",
                  static_cast<unsigned long long>(addr), static_cast<unsigned long long>(len), base, size, ordinal);
    why = buf;
    return Probe::kBad;
  }
  State& s = state();
  auto it = s.contexts.find(ordinal);
  if (it == s.contexts.end()) {
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    if (CUresult r = d->deviceGet(&dev, ordinal); r != kSuccess) {
      why = "cuDeviceGet(" + std::to_string(ordinal) + ") -> " + describe(r);
      return Probe::kBad;
    }
    if (CUresult r = d->primaryCtxRetain(&ctx, dev); r != kSuccess) {
      why = "cuDevicePrimaryCtxRetain(GPU " + std::to_string(ordinal) + ") -> " + describe(r);
      return Probe::kBad;
    }
    it = s.contexts.emplace(ordinal, ctx).first;
  }
  out.ordinal = ordinal;
  out.ctx = it->second;
  return Probe::kDevice;
}

// The copy stream of `m`'s context, made current on this thread; "" or what failed.
std::string enter(const Memory& m, CUstream& stream) {
  const Driver* d = driver();
  if (d == nullptr) return "libcuda.so.1 is no longer usable";
  if (CUresult r = d->ctxSetCurrent(m.ctx); r != kSuccess) return "cuCtxSetCurrent -> " + describe(r);
  State& s = state();
  auto it = s.streams.find(m.ctx);
  if (it == s.streams.end()) {
    CUstream st = nullptr;
    if (CUresult r = d->streamCreate(&st, kStreamNonBlocking); r != kSuccess) return "cuStreamCreate -> " + describe(r);
    it = s.streams.emplace(m.ctx, st).first;
  }
  stream = it->second;
  return "";
}

// Synchronous copies: when they return "", the bytes are at the destination (a later copy lands after them).
std::string toDevice(const Memory& m, uint8_t* dst, const uint8_t* src, uint64_t n) {
  CUstream st = nullptr;
  if (std::string e = enter(m, st); !e.empty()) return e;
  const Driver* d = driver();
  if (CUresult r = d->memcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, n, st); r != kSuccess)
    return "cuMemcpyHtoDAsync -> " + describe(r);
  if (CUresult r = d->streamSynchronize(st); r != kSuccess)
    return "cuStreamSynchronize after cuMemcpyHtoDAsync -> " + describe(r);
  return "";
}
std::string toHost(const Memory& m, uint8_t* dst, const uint8_t* src, uint64_t n) {
  CUstream st = nullptr;
  if (std::string e = enter(m, st); !e.empty()) return e;
  const Driver* d = driver();
  if (CUresult r = d->memcpyDtoHAsync(dst, reinterpret_cast<CUdeviceptr>(src), n, st); r != kSuccess)
    return "cuMemcpyDtoHAsync -> " + describe(r);
  if (CUresult r = d->streamSynchronize(st); r != kSuccess)
    return "cuStreamSynchronize after cuMemcpyDtoHAsync -> " + describe(r);
  return "";
}

}  // namespace gpu

struct Pd;
struct Cq;
struct Qp;

struct Device {
  ibv_device dev{};
};

struct Context {
  ibv_context ctx{};  // first member: ibv_context* <-> Context*
};

struct Pd {
  ibv_pd pd{};
  int mrs = 0;
  int qps = 0;
};

struct Mr {
  ibv_mr mr{};
  Pd* pd = nullptr;
  uint8_t* host = nullptr;  // where the bytes are in this process
  uint64_t iova = 0;        // the address SGEs and peers use
  uint64_t length = 0;
  int access = 0;
  void* mapped = nullptr;   // dmabuf: our mapping of the fd
  size_t mappedLength = 0;
  bool device = false;      // `host` is a CUDA device pointer: bytes move with the driver's copies
  gpu::Memory gpu;
  uint64_t bytesIn = 0, bytesOut = 0;  // device MRs: what the double copied into and out of it (for the log)
};

// Bytes an SGE or a remote address names, inside MR `mr`: host memory of this process, or GPU memory.
struct Place {
  uint8_t* p = nullptr;
  Mr* mr = nullptr;  // valid while the Hca's mutex is held (ibv_dereg_mr takes it too)
  explicit operator bool() const { return p != nullptr; }
  bool device() const { return mr != nullptr && mr->device; }
};

// A device copy failed: says so on stderr (tandemd's log), where a real HCA's fault would leave a vendor error.
void reportCopyFailure(const char* what, bool into, uint64_t bytes, const Place& at, uint32_t qpn,
                       const std::string& why) {
  std::fprintf(stderr, "verbs double: %s: copying %llu bytes %s GPU %d memory at %p (MR key 0x%x) failed: %s; the "
                       "work request fails and QP 0x%x enters the error state\n", what,
               static_cast<unsigned long long>(bytes), into ? "into" : "out of", at.mr->gpu.ordinal,
               static_cast<void*>(at.p), at.mr->mr.lkey, why.c_str(), qpn);
}

// `n` bytes from host memory into `to`: memcpy for host memory, a synchronous driver copy for GPU memory (so a
// later packet's bytes, the flag after the data, land after these). False (reported) when the device copy failed.
bool store(const Place& to, const uint8_t* from, uint64_t n, const char* what, uint32_t qpn) {
  if (n == 0) return true;
  if (!to.device()) {
    std::memcpy(to.p, from, n);
    return true;
  }
  if (std::string why = gpu::toDevice(to.mr->gpu, to.p, from, n); !why.empty()) {
    reportCopyFailure(what, true, n, to, qpn, why);
    return false;
  }
  to.mr->bytesIn += n;
  return true;
}
// `n` bytes of `from` into host memory, as store.
bool load(uint8_t* to, const Place& from, uint64_t n, const char* what, uint32_t qpn) {
  if (n == 0) return true;
  if (!from.device()) {
    std::memcpy(to, from.p, n);
    return true;
  }
  if (std::string why = gpu::toHost(from.mr->gpu, to, from.p, n); !why.empty()) {
    reportCopyFailure(what, false, n, from, qpn, why);
    return false;
  }
  from.mr->bytesOut += n;
  return true;
}

struct Cqe {
  Clock::time_point visibleAt;
  ibv_wc wc;
  uint64_t sqSeq;  // send completions: the WQE's sequence number (retires the send queue up to it); else ~0
};

struct Cq {
  ibv_cq cq{};
  std::deque<Cqe> entries;
  int capacity = 0;
  bool overrun = false;
  int qps = 0;
};

struct SendWqe {
  uint64_t wrId = 0;
  uint64_t seq = 0;
  ibv_wr_opcode opcode = IBV_WR_RDMA_WRITE;
  bool signaled = false;
  std::vector<ibv_sge> sges;
  bool isInline = false;
  std::vector<uint8_t> inlineData;
  uint64_t remoteAddr = 0;
  uint32_t rkey = 0;
  uint32_t imm = 0;
  bool hasImm = false;
  uint64_t length = 0;
  // Fails with this status (instead of being sent) once every earlier WQE has completed: RC completes in order.
  ibv_wc_status failWith = IBV_WC_SUCCESS;
};

struct RecvWqe {
  uint64_t wrId = 0;
  std::vector<ibv_sge> sges;
};

struct Conn;

struct Qp {
  ibv_qp qp{};
  Pd* pd = nullptr;
  Cq* scq = nullptr;
  Cq* rcq = nullptr;
  ibv_qp_cap cap{};
  bool sigAll = false;
  ibv_qp_state hw = IBV_QPS_RESET;  // the state the HCA has (errors move it; ibv_qp::state follows modify_qp only)
  unsigned accessFlags = 0;
  // RTR
  uint32_t destQpn = 0;
  uint32_t destPid = 0;
  bool destIsDouble = false;
  ibv_mtu pathMtu = IBV_MTU_1024;
  // send side
  std::deque<SendWqe> sq;        // posted, not yet transmitted
  std::deque<SendWqe> inflight;  // transmitted, awaiting the responder's answer
  uint64_t nextSeq = 0;          // sequence number of the next posted WQE
  uint64_t retiredSeq = 0;       // WQEs below this have been retired by a polled completion
  Conn* out = nullptr;           // the stream to the destination's HCA
  bool peerGone = false;         // the destination closed the stream: the next WQE fails
  bool stalled = false;          // a WQE waits to fail in order: nothing after it is sent
  Clock::time_point retryConnectAt{};
  // receive side
  std::deque<RecvWqe> rq;
};

struct Conn {
  int fd = -1;
  bool outbound = false;
  bool dead = false;
  uint32_t qpn = 0;           // outbound: the requester QP; inbound: the responder QP once Hello is accepted
  bool bound = false;         // inbound: Hello accepted
  // output
  std::vector<uint8_t> wbuf;
  size_t wpos = 0;
  // input
  enum class Phase { kHeader, kToMemory, kToTemp, kDiscard } phase = Phase::kHeader;
  Packet hdr{};
  size_t hdrGot = 0;
  bool headerReady = false;   // a full header waits to be acted on (parked: INIT responder, RNR)
  uint8_t* dst = nullptr;     // kToMemory
  std::vector<uint8_t> temp;  // kToTemp
  bool placeFromTemp = false; // an RDMA WRITE into GPU memory: the payload lands in temp, then the driver copies it
  uint64_t need = 0, got = 0;
  // what to do when the payload is in (responder): the NAK status (0 = ACK), the receive to complete
  uint32_t nakStatus = 0;
  bool parkedCounted = false;
};

uint64_t toIova(const void* p) { return reinterpret_cast<uint64_t>(p); }

class Hca {
 public:
  std::mutex mu;
  Faults faults;
  bool faultsFromApi = false;

  // ---- lifecycle ----
  int openContext() {
    if (contexts_++ > 0) return 0;
    if (!faultsFromApi) {
      if (!parseFaults(std::getenv("TANDEM_VERBS_DOUBLE_FAULTS"), faults)) {
        std::fprintf(stderr, "verbs double: TANDEM_VERBS_DOUBLE_FAULTS=%s is not a fault spec "
                             "(delay_completions_ms=N,qp_error_after_writes=N,vanish_after_writes=N); ignored\n",
                     std::getenv("TANDEM_VERBS_DOUBLE_FAULTS"));
        faults = Faults{};
      }
    }
    pid_ = static_cast<uint32_t>(::getpid());
    const char* dir = std::getenv("TANDEM_VERBS_DOUBLE_DIR");
    path_ = socketPath(dir && *dir ? dir : "/tmp", pid_);
    if (path_.size() >= sizeof(sockaddr_un::sun_path)) {
      std::fprintf(stderr, "verbs double: socket path %s is longer than a unix socket address allows; set "
                           "TANDEM_VERBS_DOUBLE_DIR to a shorter directory\n", path_.c_str());
      contexts_ = 0;
      return ENAMETOOLONG;
    }
    listenFd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_un a = address(path_);
    ::unlink(path_.c_str());
    if (listenFd_ < 0 || ::bind(listenFd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listenFd_, 128) != 0) {
      const int err = errno;
      std::fprintf(stderr, "verbs double: cannot listen on %s: %s; set TANDEM_VERBS_DOUBLE_DIR to a writable "
                           "directory with a short path\n", path_.c_str(), std::strerror(err));
      if (listenFd_ >= 0) ::close(listenFd_);
      listenFd_ = -1;
      contexts_ = 0;
      return err ? err : EIO;
    }
    wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    stop_ = false;
    vanished_ = false;
    thread_ = std::thread([this] { run(); });
    return 0;
  }

  // Called with mu held; releases it while joining the thread.
  void closeContext(std::unique_lock<std::mutex>& lock) {
    if (contexts_ == 0 || --contexts_ > 0) return;
    stop_ = true;
    wake();
    lock.unlock();
    if (thread_.joinable()) thread_.join();
    lock.lock();
    for (auto& c : conns_) closeConn(*c);
    conns_.clear();
    if (listenFd_ >= 0) {
      ::close(listenFd_);
      ::unlink(path_.c_str());
      listenFd_ = -1;
    }
    if (wakeFd_ >= 0) ::close(wakeFd_);
    wakeFd_ = -1;
  }

  static std::string socketPath(const std::string& dir, uint32_t pid) {
    return dir + "/tdbl-" + std::to_string(pid) + ".sock";
  }
  static sockaddr_un address(const std::string& path) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    return a;
  }

  uint32_t pid() const { return pid_; }
  void gid(ibv_gid& g) const {
    std::memset(&g, 0, sizeof g);
    g.raw[0] = 0xfe;
    g.raw[1] = 0x80;
    g.raw[8] = 'T';
    g.raw[9] = 'D';
    g.raw[10] = 'B';
    g.raw[11] = 'L';
    for (int i = 0; i < 4; ++i) g.raw[12 + i] = static_cast<uint8_t>(pid_ >> (8 * (3 - i)));
  }
  static bool pidOfGid(const ibv_gid& g, uint32_t& pid) {
    if (g.raw[0] != 0xfe || g.raw[1] != 0x80 || g.raw[8] != 'T' || g.raw[9] != 'D' || g.raw[10] != 'B' ||
        g.raw[11] != 'L')
      return false;
    pid = 0;
    for (int i = 0; i < 4; ++i) pid = (pid << 8) | g.raw[12 + i];
    return true;
  }

  void wake() {
    if (wakeFd_ < 0) return;
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wakeFd_, &one, sizeof one);
  }

  // ---- objects (mu held) ----
  uint32_t newKey() {
    // Distinct per process and MR; never 0.
    keySeed_ = keySeed_ * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t k = static_cast<uint32_t>(keySeed_ >> 33) | 1u;
    while (mrs_.contains(k)) k += 2;
    return k;
  }
  uint32_t newQpn() {
    for (;;) {
      nextQpn_ = (nextQpn_ + 1) & k24Bits;
      if (nextQpn_ < 0x10) nextQpn_ = 0x10;  // low QPNs are special (QP0/QP1) on real HCAs
      if (!qps_.contains(nextQpn_)) return nextQpn_;
    }
  }
  std::unordered_map<uint32_t, Mr*>& mrs() { return mrs_; }
  std::unordered_map<uint32_t, Qp*>& qps() { return qps_; }
  Qp* qp(uint32_t qpn) {
    auto it = qps_.find(qpn);
    return it == qps_.end() ? nullptr : it->second;
  }

  uint64_t counter(const std::string& name) {
    if (name == "writes") return writes_;
    if (name == "sends") return sends_;
    if (name == "reads") return reads_;
    if (name == "recv_completions") return recvCompletions_;
    if (name == "rnr_waits") return rnrWaits_;
    if (name == "qps") return qps_.size();
    if (name == "mrs") return mrs_.size();
    return UINT64_MAX;
  }
  void resetWriteCount() { writes_ = 0; }

  // ---- completions (mu held) ----
  void pushCqe(Cq& cq, const ibv_wc& wc, uint64_t sqSeq) {
    if (static_cast<int>(cq.entries.size()) >= cq.capacity) {
      cq.overrun = true;  // a real CQ overrun is a fatal CQ error; poll_cq reports it
      return;
    }
    cq.entries.push_back(Cqe{Clock::now() + std::chrono::milliseconds(faults.delayCompletionsMs), wc, sqSeq});
    if (wc.opcode & IBV_WC_RECV) ++recvCompletions_;
  }
  void completeSend(Qp& q, const SendWqe& w, ibv_wc_status status, bool force) {
    if (!w.signaled && !force && status == IBV_WC_SUCCESS) return;
    ibv_wc wc{};
    wc.wr_id = w.wrId;
    wc.status = status;
    switch (w.opcode) {
      case IBV_WR_RDMA_WRITE:
      case IBV_WR_RDMA_WRITE_WITH_IMM: wc.opcode = IBV_WC_RDMA_WRITE; break;
      case IBV_WR_RDMA_READ: wc.opcode = IBV_WC_RDMA_READ; break;
      default: wc.opcode = IBV_WC_SEND; break;
    }
    wc.byte_len = status == IBV_WC_SUCCESS && w.opcode == IBV_WR_RDMA_READ ? static_cast<uint32_t>(w.length) : 0;
    wc.qp_num = q.qp.qp_num;
    pushCqe(*q.scq, wc, w.seq);
  }
  void completeRecv(Qp& q, const RecvWqe& r, ibv_wc_status status, ibv_wc_opcode op, uint32_t bytes, bool imm,
                    uint32_t immData) {
    ibv_wc wc{};
    wc.wr_id = r.wrId;
    wc.status = status;
    wc.opcode = op;
    wc.byte_len = bytes;
    wc.qp_num = q.qp.qp_num;
    wc.src_qp = q.destQpn;
    if (imm) {
      wc.wc_flags = IBV_WC_WITH_IMM;
      wc.imm_data = immData;
    }
    pushCqe(*q.rcq, wc, ~uint64_t{0});
  }

  // The QP enters the error state: `first` (if any) completes with `status`, every other outstanding work request
  // flushes, and its streams close.
  void qpError(Qp& q, const SendWqe* first, ibv_wc_status status) {
    if (first != nullptr) completeSend(q, *first, status, true);
    if (q.hw == IBV_QPS_ERR) return;
    q.hw = IBV_QPS_ERR;
    flushAll(q);
    dropConns(q);
  }
  void flushAll(Qp& q) {
    for (const SendWqe& w : q.inflight) completeSend(q, w, IBV_WC_WR_FLUSH_ERR, true);
    for (const SendWqe& w : q.sq) completeSend(q, w, IBV_WC_WR_FLUSH_ERR, true);
    q.inflight.clear();
    q.sq.clear();
    for (const RecvWqe& r : q.rq) completeRecv(q, r, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
    q.rq.clear();
  }
  // Closes the QP's outbound stream and the inbound streams bound to it (a responder in error answers nothing).
  void dropConns(Qp& q) {
    for (auto& c : conns_) {
      if (c->dead) continue;
      const bool mine = c->outbound ? (c->qpn == q.qp.qp_num && q.out == c.get()) : (c->bound && c->qpn == q.qp.qp_num);
      if (mine) closeConn(*c);
    }
    q.out = nullptr;
  }
  void resetQp(Qp& q) {
    dropConns(q);
    q.sq.clear();
    q.inflight.clear();
    q.rq.clear();
    q.retiredSeq = q.nextSeq;
    q.peerGone = false;
    q.stalled = false;
    q.destIsDouble = false;
    q.hw = IBV_QPS_RESET;
  }

  void vanishLocked() {
    vanished_ = true;
    if (listenFd_ >= 0) {
      ::close(listenFd_);
      ::unlink(path_.c_str());
      listenFd_ = -1;
    }
    for (auto& [qpn, q] : qps_) {
      if (q->hw == IBV_QPS_ERR || q->hw == IBV_QPS_RESET) continue;
      std::optional<SendWqe> first;
      if (!q->inflight.empty()) {
        first = std::move(q->inflight.front());
        q->inflight.pop_front();
      } else if (!q->sq.empty()) {
        first = std::move(q->sq.front());
        q->sq.pop_front();
      }
      qpError(*q, first ? &*first : nullptr, IBV_WC_RETRY_EXC_ERR);
    }
    for (auto& c : conns_) closeConn(*c);
  }

  // ---- the service thread ----
  void run() {
    std::vector<pollfd> fds;
    std::vector<Conn*> polled;
    std::unique_lock lock(mu);
    while (!stop_) {
      fds.clear();
      polled.clear();
      fds.push_back({wakeFd_, POLLIN, 0});
      if (listenFd_ >= 0) fds.push_back({listenFd_, POLLIN, 0});
      const size_t firstConn = fds.size();
      bool timed = false;
      for (auto& c : conns_) {
        if (c->dead) continue;
        short ev = 0;
        if (!c->headerReady) ev |= POLLIN;
        if (c->wpos < c->wbuf.size()) ev |= POLLOUT;
        fds.push_back({c->fd, ev, 0});
        polled.push_back(c.get());
        if (c->headerReady) timed = true;
      }
      for (auto& [qpn, q] : qps_) {
        if (!q->sq.empty() && q->out == nullptr) timed = true;  // a connect to retry
      }
      lock.unlock();
      // Parked streams and connect retries are re-examined every millisecond; everything else wakes the poll.
      ::poll(fds.data(), fds.size(), timed ? 1 : 100);
      lock.lock();
      if (stop_) break;
      uint64_t drained;
      while (::read(wakeFd_, &drained, sizeof drained) > 0) {
      }
      if (listenFd_ >= 0) acceptAll();
      for (size_t i = 0; i < polled.size(); ++i) {
        Conn& c = *polled[i];
        const short rev = fds[firstConn + i].revents;
        if (c.dead) continue;
        if (rev & (POLLIN | POLLHUP | POLLERR)) readConn(c);
        if (!c.dead && (rev & POLLOUT)) flushOut(c);
      }
      progress();
      std::erase_if(conns_, [](const std::unique_ptr<Conn>& c) { return c->dead; });
    }
  }

  // Everything that may move without socket events: parked headers, transmits, writes of queued bytes.
  void progress() {
    for (auto& c : conns_) {
      if (!c->dead && c->headerReady) readConn(*c);
    }
    for (auto& [qpn, q] : qps_) transmit(*q);
    for (auto& c : conns_) {
      if (!c->dead && c->wpos < c->wbuf.size()) flushOut(*c);
    }
  }

  void acceptAll() {
    for (;;) {
      const int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      conns_.push_back(std::move(c));
    }
  }

  void closeConn(Conn& c) {
    if (c.dead) return;
    c.dead = true;
    if (c.fd >= 0) ::close(c.fd);
    c.fd = -1;
    if (c.outbound) {
      if (Qp* q = qp(c.qpn); q && q->out == &c) q->out = nullptr;
    }
  }

  void queue(Conn& c, const Packet& p, const void* data = nullptr, size_t bytes = 0) {
    const auto* h = reinterpret_cast<const uint8_t*>(&p);
    c.wbuf.insert(c.wbuf.end(), h, h + sizeof p);
    if (bytes) {
      const auto* d = static_cast<const uint8_t*>(data);
      c.wbuf.insert(c.wbuf.end(), d, d + bytes);
    }
  }

  void flushOut(Conn& c) {
    while (c.wpos < c.wbuf.size()) {
      const ssize_t n = ::send(c.fd, c.wbuf.data() + c.wpos, c.wbuf.size() - c.wpos, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.wpos += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
      peerClosed(c);
      return;
    }
    if (c.wpos == c.wbuf.size()) {
      c.wbuf.clear();
      c.wpos = 0;
    } else if (c.wpos > (1u << 20)) {
      c.wbuf.erase(c.wbuf.begin(), c.wbuf.begin() + static_cast<std::ptrdiff_t>(c.wpos));
      c.wpos = 0;
    }
  }

  // The other end closed or reset the stream.
  void peerClosed(Conn& c) {
    const bool outbound = c.outbound;
    const uint32_t qpn = c.qpn;
    closeConn(c);
    if (!outbound) return;  // a requester went away: nothing outstanding here depends on it
    Qp* q = qp(qpn);
    if (q == nullptr) return;
    q->peerGone = true;
    if (!q->inflight.empty()) {
      SendWqe w = q->inflight.front();
      q->inflight.pop_front();
      qpError(*q, &w, IBV_WC_RETRY_EXC_ERR);
    }
  }

  // Reads and acts on packets until the socket has no more, the stream parks, or it closes.
  void readConn(Conn& c) {
    for (int rounds = 0; rounds < 256 && !c.dead; ++rounds) {
      if (c.phase == Conn::Phase::kHeader) {
        if (!c.headerReady) {
          const ssize_t n = ::recv(c.fd, reinterpret_cast<uint8_t*>(&c.hdr) + c.hdrGot, sizeof c.hdr - c.hdrGot,
                                   MSG_DONTWAIT);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return peerClosed(c);
          if (n < 0) return;
          c.hdrGot += static_cast<size_t>(n);
          if (c.hdrGot < sizeof c.hdr) continue;
          c.hdrGot = 0;
          c.headerReady = true;
        }
        if (!dispatch(c)) return;  // parked: the header stays ready
        c.headerReady = false;
        if (c.phase == Conn::Phase::kHeader) finishPacket(c);
        continue;
      }
      // payload
      const uint64_t left = c.need - c.got;
      if (left > 0) {
        uint8_t scratch[65536];
        uint8_t* into = c.phase == Conn::Phase::kToMemory ? c.dst + c.got
                        : c.phase == Conn::Phase::kToTemp  ? c.temp.data() + c.got
                                                           : scratch;
        const size_t want = c.phase == Conn::Phase::kDiscard ? std::min<uint64_t>(left, sizeof scratch) : left;
        const ssize_t n = ::recv(c.fd, into, want, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return peerClosed(c);
        if (n < 0) return;
        c.got += static_cast<uint64_t>(n);
        if (c.got < c.need) continue;
      }
      finishPacket(c);
      c.phase = Conn::Phase::kHeader;
    }
  }

  // Decides what a full header means. False: park (the header is looked at again later).
  bool dispatch(Conn& c) {
    const Packet& h = c.hdr;
    c.need = c.got = 0;
    c.nakStatus = 0;
    c.placeFromTemp = false;
    if (c.outbound) return dispatchRequester(c);
    if (h.type == kHello) {
      Qp* q = qp(h.b);
      if (q != nullptr && q->hw == IBV_QPS_INIT) {  // not connected yet: its peer retries until it is
        if (!c.parkedCounted) c.parkedCounted = true;
        return false;
      }
      if (q == nullptr || (q->hw != IBV_QPS_RTR && q->hw != IBV_QPS_RTS) || q->destQpn != h.a ||
          q->destPid != static_cast<uint32_t>(h.addr)) {
        dropStream(c);
        return true;
      }
      c.qpn = h.b;
      c.bound = true;
      c.phase = Conn::Phase::kHeader;
      return true;
    }
    Qp* q = c.bound ? qp(c.qpn) : nullptr;
    if (q == nullptr || (q->hw != IBV_QPS_RTR && q->hw != IBV_QPS_RTS)) {
      dropStream(c);
      return true;
    }
    const bool needsRecv = h.type == kSend || h.type == kWriteImm;
    if (needsRecv && q->rq.empty()) {
      if (!c.parkedCounted) {
        ++rnrWaits_;
        c.parkedCounted = true;
      }
      return false;  // RNR: wait for a posted receive
    }
    c.parkedCounted = false;
    switch (h.type) {
      case kWrite:
      case kWriteImm: {
        c.need = h.len;
        if (h.len == 0) {  // zero-length writes touch no memory and check no key
          c.phase = Conn::Phase::kToMemory;
          return true;
        }
        const Place dst = resolveRemote(*q, h.addr, h.rkey, h.len, IBV_ACCESS_REMOTE_WRITE);
        if (!dst) {
          c.phase = Conn::Phase::kDiscard;
          c.nakStatus = IBV_WC_REM_ACCESS_ERR;
        } else if (dst.device()) {
          // The socket cannot read into GPU memory: the payload is gathered, then placed whole by finishPacket.
          c.phase = Conn::Phase::kToTemp;
          c.temp.resize(h.len);
          c.placeFromTemp = true;
        } else {
          c.phase = Conn::Phase::kToMemory;
          c.dst = dst.p;
        }
        return true;
      }
      case kSend:
        c.need = h.len;
        c.temp.resize(h.len);
        c.phase = Conn::Phase::kToTemp;
        return true;
      case kReadReq: {
        const Place src = h.len ? resolveRemote(*q, h.addr, h.rkey, h.len, IBV_ACCESS_REMOTE_READ) : Place{};
        Packet r{};
        r.seq = h.seq;
        uint32_t status = h.len != 0 && !src ? IBV_WC_REM_ACCESS_ERR : 0;
        std::vector<uint8_t> staged;  // GPU memory: read out by the driver before the response is queued
        if (status == 0 && src.device()) {
          staged.resize(h.len);
          if (!load(staged.data(), src, h.len, "RDMA READ (responder)", q->qp.qp_num)) status = IBV_WC_REM_OP_ERR;
        }
        if (status != 0) {
          r.type = kNak;
          r.a = status;
          queue(c, r);
          flushOut(c);
          qpError(*q, nullptr, static_cast<ibv_wc_status>(status));
        } else {
          r.type = kReadResp;
          r.len = h.len;
          queue(c, r, src.device() ? staged.data() : src.p, h.len);
        }
        c.phase = Conn::Phase::kHeader;
        c.hdr.type = 0;  // nothing left to finish
        return true;
      }
      default:
        dropStream(c);  // garbage: a real HCA would drop the packet; the stream cannot be resynchronised
        return true;
    }
  }

  void dropStream(Conn& c) {
    Packet d{};
    d.type = kDrop;
    queue(c, d);
    flushOut(c);
    closeConn(c);
    c.hdr.type = 0;
  }

  // Responder: the bytes of MR `rkey` at [addr, addr+len), if the QP and MR allow `access`; empty otherwise.
  Place resolveRemote(Qp& q, uint64_t addr, uint32_t rkey, uint64_t len, int access) {
    auto it = mrs_.find(rkey);
    if (it == mrs_.end()) return {};
    Mr& m = *it->second;
    if (m.pd != q.pd || !(m.access & access) || !(q.accessFlags & static_cast<unsigned>(access))) return {};
    if (addr < m.iova || len > m.length || addr - m.iova > m.length - len) return {};
    return {m.host + (addr - m.iova), &m};
  }
  // Local SGE: the bytes it names in an MR of `pd` (with LOCAL_WRITE when `write`); empty otherwise.
  Place resolveLocal(Pd* pd, const ibv_sge& s, bool write) {
    auto it = mrs_.find(s.lkey);
    if (it == mrs_.end()) return {};
    Mr& m = *it->second;
    if (m.pd != pd || (write && !(m.access & IBV_ACCESS_LOCAL_WRITE))) return {};
    if (s.addr < m.iova || s.length > m.length || s.addr - m.iova > m.length - s.length) return {};
    return {m.host + (s.addr - m.iova), &m};
  }

  // A packet's payload is in (or it had none): act on it and answer.
  void finishPacket(Conn& c) {
    const Packet h = c.hdr;
    if (c.outbound) return finishRequester(c);
    if (h.type != kWrite && h.type != kWriteImm && h.type != kSend) return;
    Qp* q = qp(c.qpn);
    Packet r{};
    r.seq = h.seq;
    if (q == nullptr || q->hw == IBV_QPS_ERR || q->hw == IBV_QPS_RESET) {
      dropStream(c);
      return;
    }
    uint32_t status = c.nakStatus;
    if (status == 0 && c.placeFromTemp) {
      // Looked up again: the MR may have been deregistered while the payload was arriving.
      const Place dst = resolveRemote(*q, h.addr, h.rkey, h.len, IBV_ACCESS_REMOTE_WRITE);
      if (!dst) {
        status = IBV_WC_REM_ACCESS_ERR;
      } else if (!store(dst, c.temp.data(), h.len, h.type == kWriteImm ? "RDMA WRITE with immediate (responder)"
                                                                       : "RDMA WRITE (responder)", q->qp.qp_num)) {
        status = IBV_WC_REM_OP_ERR;  // a DMA fault at the responder: its QP fails too (below)
      }
      c.temp.clear();
      c.placeFromTemp = false;
    }
    if (status == 0 && h.type == kWriteImm) {
      RecvWqe rw = std::move(q->rq.front());
      q->rq.pop_front();
      completeRecv(*q, rw, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, h.len, true, h.imm);
    } else if (status == 0 && h.type == kSend) {
      RecvWqe rw = std::move(q->rq.front());
      q->rq.pop_front();
      uint64_t room = 0;
      for (const ibv_sge& s : rw.sges) room += s.length;
      ibv_wc_status local = IBV_WC_SUCCESS;
      if (room < h.len) {
        local = IBV_WC_LOC_LEN_ERR;
        status = IBV_WC_REM_INV_REQ_ERR;
      } else {
        uint64_t off = 0;
        for (const ibv_sge& s : rw.sges) {
          if (off >= h.len) break;
          const Place d = resolveLocal(q->pd, s, true);
          if (!d) {
            local = IBV_WC_LOC_PROT_ERR;
            status = IBV_WC_REM_OP_ERR;
            break;
          }
          const uint64_t n = std::min<uint64_t>(s.length, h.len - off);
          if (!store(d, c.temp.data() + off, n, "SEND (receive buffer)", q->qp.qp_num)) {
            local = IBV_WC_LOC_QP_OP_ERR;
            status = IBV_WC_REM_OP_ERR;
            break;
          }
          off += n;
        }
      }
      completeRecv(*q, rw, local, IBV_WC_RECV, local == IBV_WC_SUCCESS ? h.len : 0, h.b == 1, h.imm);
      c.temp.clear();
    }
    if (status != 0) {
      r.type = kNak;
      r.a = status;
      queue(c, r);
      flushOut(c);  // the NAK goes out before the responder's QP, failing too, closes the stream
      qpError(*q, nullptr, static_cast<ibv_wc_status>(status));
      return;
    }
    r.type = kAck;
    queue(c, r);
  }

  bool dispatchRequester(Conn& c) {
    const Packet& h = c.hdr;
    if (h.type == kReadResp) {
      c.need = h.len;
      c.temp.resize(h.len);
      c.phase = Conn::Phase::kToTemp;
    } else {
      c.phase = Conn::Phase::kHeader;
    }
    return true;
  }

  void finishRequester(Conn& c) {
    const Packet h = c.hdr;
    Qp* q = qp(c.qpn);
    if (q == nullptr || q->out != &c) return;
    if (h.type == kDrop) {
      q->peerGone = true;
      closeConn(c);
      SendWqe w;
      if (!q->inflight.empty()) {
        w = q->inflight.front();
        q->inflight.pop_front();
        qpError(*q, &w, IBV_WC_RETRY_EXC_ERR);
      }
      return;
    }
    if (q->inflight.empty() || q->inflight.front().seq != h.seq) {
      // An answer to nothing we sent: a real requester drops it; the stream is out of step.
      closeConn(c);
      qpError(*q, nullptr, IBV_WC_BAD_RESP_ERR);
      return;
    }
    SendWqe w = std::move(q->inflight.front());
    q->inflight.pop_front();
    if (h.type == kNak) {
      qpError(*q, &w, static_cast<ibv_wc_status>(h.a));
      return;
    }
    if (h.type == kReadResp) {
      uint64_t off = 0;
      for (const ibv_sge& s : w.sges) {
        const Place d = resolveLocal(q->pd, s, true);
        if (!d) {
          qpError(*q, &w, IBV_WC_LOC_PROT_ERR);
          return;
        }
        const uint64_t n = std::min<uint64_t>(s.length, h.len - off);
        if (!store(d, c.temp.data() + off, n, "RDMA READ response (requester)", q->qp.qp_num)) {
          qpError(*q, &w, IBV_WC_LOC_QP_OP_ERR);
          return;
        }
        off += n;
      }
      c.temp.clear();
    }
    completeSend(*q, w, IBV_WC_SUCCESS, false);
    settleFront(*q);
  }

  // A WQE marked to fail fails once it is the oldest outstanding one (RC reports completions in order).
  void settleFront(Qp& q) {
    if (q.inflight.empty() || q.inflight.front().failWith == IBV_WC_SUCCESS) return;
    SendWqe w = std::move(q.inflight.front());
    q.inflight.pop_front();
    qpError(q, &w, w.failWith);
  }
  void failInOrder(Qp& q, SendWqe&& w, ibv_wc_status status) {
    w.failWith = status;
    q.inflight.push_back(std::move(w));
    q.stalled = true;
    settleFront(q);
  }

  // Requester: connects the QP's stream if needed and turns queued WQEs into packets.
  void transmit(Qp& q) {
    if (q.hw != IBV_QPS_RTS || q.stalled) return;
    while (!q.sq.empty()) {
      if (q.out == nullptr) {
        if (q.peerGone || !q.destIsDouble || vanished_) {
          SendWqe w = std::move(q.sq.front());
          q.sq.pop_front();
          qpError(q, &w, IBV_WC_RETRY_EXC_ERR);
          return;
        }
        if (Clock::now() < q.retryConnectAt) return;
        if (!connectQp(q)) return;
      }
      if (q.out->wbuf.size() - q.out->wpos > kMaxQueuedOutBytes) return;
      SendWqe w = std::move(q.sq.front());
      q.sq.pop_front();
      const bool isWrite = w.opcode == IBV_WR_RDMA_WRITE || w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
      if (isWrite && w.length > 0) {
        ++writes_;
        if (faults.qpErrorAfterWrites != 0 && writes_ == faults.qpErrorAfterWrites) {
          failInOrder(q, std::move(w), IBV_WC_RETRY_EXC_ERR);  // as a link that stopped acknowledging
          return;
        }
        if (faults.vanishAfterWrites != 0 && writes_ == faults.vanishAfterWrites) {
          q.sq.push_front(std::move(w));
          vanishLocked();
          return;
        }
      }
      Packet p{};
      p.seq = w.seq;
      p.addr = w.remoteAddr;
      p.rkey = w.rkey;
      p.len = static_cast<uint32_t>(w.length);
      p.imm = w.imm;
      switch (w.opcode) {
        case IBV_WR_RDMA_WRITE: p.type = kWrite; break;
        case IBV_WR_RDMA_WRITE_WITH_IMM: p.type = kWriteImm; break;
        case IBV_WR_SEND: p.type = kSend; break;
        case IBV_WR_SEND_WITH_IMM: p.type = kSend; p.b = 1; break;
        case IBV_WR_RDMA_READ: p.type = kReadReq; ++reads_; break;
        default: break;
      }
      if (p.type == kSend) ++sends_;
      if (p.type == kReadReq) {
        queue(*q.out, p);
      } else if (w.isInline) {
        queue(*q.out, p, w.inlineData.data(), w.inlineData.size());
      } else {
        // Gather at transmit time, as the HCA's DMA reads the source: it must stay unchanged until completion.
        std::vector<Place> srcs;
        for (const ibv_sge& sg : w.sges) {
          const Place src = sg.length ? resolveLocal(q.pd, sg, false) : Place{};
          if (sg.length && !src) {
            failInOrder(q, std::move(w), IBV_WC_LOC_PROT_ERR);
            return;
          }
          srcs.push_back(src);
        }
        std::vector<uint8_t>& wbuf = q.out->wbuf;
        const size_t mark = wbuf.size();
        queue(*q.out, p);
        for (size_t i = 0; i < w.sges.size(); ++i) {
          const uint64_t n = w.sges[i].length;
          if (n == 0) continue;
          if (!srcs[i].device()) {
            wbuf.insert(wbuf.end(), srcs[i].p, srcs[i].p + n);
            continue;
          }
          const size_t at = wbuf.size();
          wbuf.resize(at + n);
          if (!load(wbuf.data() + at, srcs[i], n, "RDMA WRITE/SEND source (requester)", q.qp.qp_num)) {
            wbuf.resize(mark);  // nothing of this packet goes out
            failInOrder(q, std::move(w), IBV_WC_LOC_QP_OP_ERR);
            return;
          }
        }
      }
      q.inflight.push_back(std::move(w));
    }
  }

  bool connectQp(Qp& q) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      q.retryConnectAt = Clock::now() + std::chrono::milliseconds(1);
      return false;
    }
    const char* dir = std::getenv("TANDEM_VERBS_DOUBLE_DIR");
    const sockaddr_un a = address(socketPath(dir && *dir ? dir : "/tmp", q.destPid));
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == EAGAIN || err == EINTR) {  // the listener's backlog is full: try again shortly
        q.retryConnectAt = Clock::now() + std::chrono::milliseconds(1);
        return false;
      }
      q.peerGone = true;  // no such HCA (ENOENT) or it is gone (ECONNREFUSED): the next WQE fails
      SendWqe w = std::move(q.sq.front());
      q.sq.pop_front();
      qpError(q, &w, IBV_WC_RETRY_EXC_ERR);
      return false;
    }
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->outbound = true;
    c->qpn = q.qp.qp_num;
    Packet hello{};
    hello.type = kHello;
    hello.a = q.qp.qp_num;
    hello.b = q.destQpn;
    hello.addr = pid_;
    queue(*c, hello);
    q.out = c.get();
    conns_.push_back(std::move(c));
    return true;
  }

 private:
  int contexts_ = 0;
  uint32_t pid_ = 0;
  std::string path_;
  int listenFd_ = -1;
  int wakeFd_ = -1;
  bool stop_ = false;
  bool vanished_ = false;
  std::thread thread_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::unordered_map<uint32_t, Mr*> mrs_;  // by key (lkey == rkey)
  std::unordered_map<uint32_t, Qp*> qps_;  // by QPN
  uint64_t keySeed_ = static_cast<uint64_t>(::getpid()) * 0x9e3779b97f4a7c15ull;
  uint32_t nextQpn_ = 0x10;
  uint64_t writes_ = 0, sends_ = 0, reads_ = 0, recvCompletions_ = 0, rnrWaits_ = 0;
};

// Leaked on purpose: no destructor may run while another thread (or an atexit handler of the program) still calls in.
Hca& hca() {
  static Hca* h = new Hca;
  return *h;
}

Device& device() {
  static Device* d = [] {
    auto* dev = new Device;
    dev->dev.node_type = IBV_NODE_CA;
    dev->dev.transport_type = IBV_TRANSPORT_IB;
    std::snprintf(dev->dev.name, sizeof dev->dev.name, "tandem_double0");
    std::snprintf(dev->dev.dev_name, sizeof dev->dev.dev_name, "uverbs_double0");
    std::snprintf(dev->dev.dev_path, sizeof dev->dev.dev_path, "/nonexistent/tandem_verbs_double");
    std::snprintf(dev->dev.ibdev_path, sizeof dev->dev.ibdev_path, "/nonexistent/tandem_verbs_double");
    return dev;
  }();
  return *d;
}

Context* ctxOf(ibv_context* c) { return reinterpret_cast<Context*>(c); }
Pd* pdOf(ibv_pd* p) { return reinterpret_cast<Pd*>(p); }
Cq* cqOf(ibv_cq* c) { return reinterpret_cast<Cq*>(c); }
Qp* qpOf(ibv_qp* q) { return reinterpret_cast<Qp*>(q); }
Mr* mrOf(ibv_mr* m) { return reinterpret_cast<Mr*>(m); }

// ---- data path entry points (through ibv_context::ops, as the header's inline functions call them) ----

int pollCq(ibv_cq* cqp, int n, ibv_wc* wc) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Cq& cq = *cqOf(cqp);
  if (cq.overrun) return -EOVERFLOW;
  const auto now = Clock::now();
  int got = 0;
  while (got < n && !cq.entries.empty() && cq.entries.front().visibleAt <= now) {
    const Cqe e = cq.entries.front();
    cq.entries.pop_front();
    wc[got++] = e.wc;
    if (e.sqSeq != ~uint64_t{0}) {
      // Polling a send completion frees its WQE's slot and those of every earlier WQE of the QP.
      if (Qp* q = h.qp(e.wc.qp_num)) q->retiredSeq = std::max(q->retiredSeq, e.sqSeq + 1);
    }
  }
  return got;
}

int reqNotifyCq(ibv_cq*, int) { return EOPNOTSUPP; }  // no completion channels in the double

int postSend(ibv_qp* qpp, ibv_send_wr* wr, ibv_send_wr** bad) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Qp& q = *qpOf(qpp);
  for (; wr != nullptr; wr = wr->next) {
    *bad = wr;
    if (q.hw != IBV_QPS_RTS && q.hw != IBV_QPS_ERR) return EINVAL;
    switch (wr->opcode) {
      case IBV_WR_RDMA_WRITE:
      case IBV_WR_RDMA_WRITE_WITH_IMM:
      case IBV_WR_SEND:
      case IBV_WR_SEND_WITH_IMM:
      case IBV_WR_RDMA_READ: break;
      default: return EINVAL;  // atomics, memory windows, TSO: not in the double
    }
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > q.cap.max_send_sge) return EINVAL;
    if (wr->num_sge > 0 && wr->sg_list == nullptr) return EINVAL;
    if (q.nextSeq - q.retiredSeq >= q.cap.max_send_wr) return ENOMEM;  // send queue full
    SendWqe w;
    w.wrId = wr->wr_id;
    w.opcode = wr->opcode;
    w.signaled = q.sigAll || (wr->send_flags & IBV_SEND_SIGNALED);
    w.remoteAddr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
    w.hasImm = wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM || wr->opcode == IBV_WR_SEND_WITH_IMM;
    w.imm = w.hasImm ? wr->imm_data : 0;
    uint64_t total = 0;
    for (int i = 0; i < wr->num_sge; ++i) total += wr->sg_list[i].length;
    if (total > kMaxMsgBytes) return EINVAL;
    w.length = total;
    if (wr->send_flags & IBV_SEND_INLINE) {
      if (wr->opcode == IBV_WR_RDMA_READ || total > q.cap.max_inline_data) return EINVAL;
      w.isInline = true;
      for (int i = 0; i < wr->num_sge; ++i) {
        const auto* p = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(wr->sg_list[i].addr));
        w.inlineData.insert(w.inlineData.end(), p, p + wr->sg_list[i].length);
      }
    } else {
      w.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    }
    w.seq = q.nextSeq++;
    if (q.hw == IBV_QPS_ERR) {
      h.completeSend(q, w, IBV_WC_WR_FLUSH_ERR, true);
      continue;
    }
    q.sq.push_back(std::move(w));
  }
  *bad = nullptr;
  h.wake();
  return 0;
}

int postRecv(ibv_qp* qpp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Qp& q = *qpOf(qpp);
  for (; wr != nullptr; wr = wr->next) {
    *bad = wr;
    if (q.hw == IBV_QPS_RESET) return EINVAL;
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > q.cap.max_recv_sge) return EINVAL;
    if (wr->num_sge > 0 && wr->sg_list == nullptr) return EINVAL;
    if (q.rq.size() >= q.cap.max_recv_wr) return ENOMEM;
    RecvWqe r;
    r.wrId = wr->wr_id;
    r.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
    if (q.hw == IBV_QPS_ERR) {
      h.completeRecv(q, r, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, false, 0);
      continue;
    }
    q.rq.push_back(std::move(r));
  }
  *bad = nullptr;
  h.wake();
  return 0;
}

// ---- modify_qp: the RC transitions and their attribute masks (IBTA 11.2.4.1) ----
struct Rule {
  ibv_qp_state from, to;
  int required, optional;
};
constexpr int kRtsOptional = IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH |
                             IBV_QP_PATH_MIG_STATE;
constexpr Rule kRules[] = {
    {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, IBV_QP_STATE, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS},
    {IBV_QPS_INIT, IBV_QPS_RTR,
     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
         IBV_QP_MIN_RNR_TIMER,
     IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX},
    {IBV_QPS_RTR, IBV_QPS_RTS,
     IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
     kRtsOptional},
    {IBV_QPS_RTS, IBV_QPS_RTS, IBV_QP_STATE, kRtsOptional},
};

int modifyQp(Qp& q, const ibv_qp_attr& a, int mask) {
  Hca& h = hca();
  const ibv_qp_state cur = q.hw;
  const ibv_qp_state to = (mask & IBV_QP_STATE) ? a.qp_state : cur;
  if ((mask & IBV_QP_CUR_STATE) && a.cur_qp_state != cur) return EINVAL;
  if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
    if ((mask & ~IBV_QP_STATE) != 0 || !(mask & IBV_QP_STATE)) return EINVAL;
    if (to == IBV_QPS_RESET) {
      h.resetQp(q);
    } else {
      h.qpError(q, nullptr, IBV_WC_WR_FLUSH_ERR);
    }
    q.qp.state = to;
    return 0;
  }
  const Rule* rule = nullptr;
  for (const Rule& r : kRules) {
    if (r.from == cur && r.to == to) rule = &r;
  }
  if (rule == nullptr) return EINVAL;  // not a transition an RC QP makes (e.g. INIT -> RTS, or out of ERR)
  const int required = (mask & IBV_QP_STATE) ? rule->required : 0;
  if ((mask & required) != required) return EINVAL;
  if ((mask & ~(rule->required | rule->optional)) != 0) return EINVAL;
  // Values.
  if ((mask & IBV_QP_PORT) && a.port_num != 1) return EINVAL;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return EINVAL;
  constexpr unsigned kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                               IBV_ACCESS_REMOTE_ATOMIC;
  if ((mask & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~kAccess) != 0) return EINVAL;
  if ((mask & IBV_QP_PATH_MTU) && (a.path_mtu < IBV_MTU_256 || a.path_mtu > kActiveMtu)) return EINVAL;
  if ((mask & IBV_QP_DEST_QPN) && (a.dest_qp_num == 0 || a.dest_qp_num > k24Bits)) return EINVAL;
  if ((mask & IBV_QP_RQ_PSN) && a.rq_psn > k24Bits) return EINVAL;
  if ((mask & IBV_QP_SQ_PSN) && a.sq_psn > k24Bits) return EINVAL;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > kMaxQpRdAtom) return EINVAL;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > kMaxQpRdAtom) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && a.timeout > 31) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return EINVAL;
  uint32_t destPid = 0;
  bool destIsDouble = false;
  if (mask & IBV_QP_AV) {
    const ibv_ah_attr& ah = a.ah_attr;
    // RoCE: every path carries a GRH, from a populated source GID entry.
    if (ah.port_num != 1 || !ah.is_global || ah.grh.sgid_index != 0) return EINVAL;
    bool zero = true;
    for (uint8_t b : ah.grh.dgid.raw) zero = zero && b == 0;
    if (zero) return EINVAL;
    destIsDouble = Hca::pidOfGid(ah.grh.dgid, destPid);  // another GID is unreachable: sends fail later, not here
  }
  // Apply.
  if (mask & IBV_QP_ACCESS_FLAGS) q.accessFlags = a.qp_access_flags;
  if (mask & IBV_QP_PATH_MTU) q.pathMtu = a.path_mtu;
  if (mask & IBV_QP_DEST_QPN) q.destQpn = a.dest_qp_num;
  if (mask & IBV_QP_AV) {
    q.destPid = destPid;
    q.destIsDouble = destIsDouble;
  }
  q.hw = to;
  q.qp.state = to;
  h.wake();  // a responder that reached RTR may now take parked streams
  return 0;
}

}  // namespace

// ---- the exported libibverbs subset ----
extern "C" {

ibv_device** ibv_get_device_list(int* num) {
  const char* n = std::getenv("TANDEM_VERBS_DOUBLE_DEVICES");
  const int count = (n != nullptr && std::strcmp(n, "0") == 0) ? 0 : 1;
  auto** list = static_cast<ibv_device**>(std::calloc(static_cast<size_t>(count) + 1, sizeof(ibv_device*)));
  if (list == nullptr) {
    errno = ENOMEM;
    return nullptr;
  }
  if (count == 1) list[0] = &device().dev;
  if (num) *num = count;
  return list;
}

void ibv_free_device_list(ibv_device** list) { std::free(list); }

const char* ibv_get_device_name(ibv_device* dev) { return dev ? dev->name : nullptr; }

ibv_context* ibv_open_device(ibv_device* dev) {
  if (dev != &device().dev) {
    errno = ENODEV;
    return nullptr;
  }
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  if (const int rc = h.openContext(); rc != 0) {
    errno = rc;
    return nullptr;
  }
  auto* c = new Context;
  c->ctx.device = dev;
  c->ctx.ops.poll_cq = pollCq;
  c->ctx.ops.req_notify_cq = reqNotifyCq;
  c->ctx.ops.post_send = postSend;
  c->ctx.ops.post_recv = postRecv;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = -1;
  c->ctx.num_comp_vectors = 1;
  c->ctx.abi_compat = nullptr;  // not an extended verbs_context: the header's inline wrappers call our functions
  pthread_mutex_init(&c->ctx.mutex, nullptr);
  return &c->ctx;
}

int ibv_close_device(ibv_context* ctx) {
  Hca& h = hca();
  {
    std::unique_lock lock(h.mu);
    h.closeContext(lock);
  }
  pthread_mutex_destroy(&ctx->mutex);
  delete ctxOf(ctx);
  return 0;
}

int ibv_query_device(ibv_context*, ibv_device_attr* a) {
  std::memset(a, 0, sizeof *a);
  std::snprintf(a->fw_ver, sizeof a->fw_ver, "tandem-verbs-double");
  a->max_mr_size = ~uint64_t{0};
  a->page_size_cap = 0xfffff000;
  a->vendor_id = 0;
  a->max_qp = 1 << 20;
  a->max_qp_wr = kMaxQpWr;
  a->max_sge = kMaxSge;
  a->max_cq = 1 << 20;
  a->max_cqe = kMaxCqe;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 20;
  a->max_qp_rd_atom = kMaxQpRdAtom;
  a->max_qp_init_rd_atom = kMaxQpRdAtom;
  a->phys_port_cnt = 1;
  a->max_pkeys = 1;
  return 0;
}

int ibv_query_port(ibv_context*, uint8_t port, _compat_ibv_port_attr* out) {
  if (port != 1) return EINVAL;
  // Only the fields of the older (compat) layout: the caller's struct is at least that large.
  auto* a = reinterpret_cast<ibv_port_attr*>(out);
  a->state = IBV_PORT_ACTIVE;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = kActiveMtu;
  a->gid_tbl_len = kGidTableLen;
  a->port_cap_flags = 0;
  a->max_msg_sz = kMaxMsgBytes;
  a->pkey_tbl_len = 1;
  a->lid = 0;  // RoCE: no LID
  a->sm_lid = 0;
  a->active_width = 2;  // 4x
  a->active_speed = 32; // NDR-class; a number only
  a->phys_state = 5;    // LinkUp
  a->link_layer = IBV_LINK_LAYER_ETHERNET;
  return 0;
}

int ibv_query_gid(ibv_context*, uint8_t port, int index, ibv_gid* gid) {
  if (port != 1 || index < 0 || index >= kGidTableLen) return EINVAL;
  if (index == 0) {
    Hca& h = hca();
    std::lock_guard lock(h.mu);
    h.gid(*gid);
  } else {
    std::memset(gid, 0, sizeof *gid);
  }
  return 0;
}

ibv_pd* ibv_alloc_pd(ibv_context* ctx) {
  auto* p = new Pd;
  p->pd.context = ctx;
  static std::atomic<uint32_t> handles{1};
  p->pd.handle = handles++;
  return &p->pd;
}

int ibv_dealloc_pd(ibv_pd* pd) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Pd* p = pdOf(pd);
  if (p->mrs > 0 || p->qps > 0) return EBUSY;
  delete p;
  return 0;
}

// `mapped`: the double's own mapping of a dma-buf (host memory by construction). Otherwise [host, +length) is
// probed: GPU memory of this process registers as a device MR. notDeviceErrno != 0: it must be GPU memory (a dma-buf
// the double could not map), and registration fails with that errno where it is not.
static ibv_mr* registerMr(ibv_pd* pd, uint8_t* host, size_t length, uint64_t iova, int access, void* mapped,
                          size_t mappedLength, int notDeviceErrno = 0) {
  if (pd == nullptr || host == nullptr || length == 0) {
    errno = EINVAL;
    return nullptr;
  }
  // Remote write (and atomics) need local write, as libibverbs and the kernel insist.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
    errno = EINVAL;
    return nullptr;
  }
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  gpu::Memory mem;
  bool device = false;
  if (mapped == nullptr) {
    std::string why;
    switch (gpu::probe(toIova(host), length, mem, why)) {
      case gpu::Probe::kHost: break;
      case gpu::Probe::kDevice: device = true; break;
      case gpu::Probe::kBad:
        // As a real HCA whose peer-memory client cannot pin the range.
        std::fprintf(stderr, "verbs double: cannot register %zu bytes of GPU memory at %p: %s\n", length,
                     static_cast<void*>(host), why.c_str());
        errno = EFAULT;
        return nullptr;
    }
  }
  if (notDeviceErrno != 0 && !device) {
    errno = notDeviceErrno;
    return nullptr;
  }
  auto* m = new Mr;
  m->pd = pdOf(pd);
  m->host = host;
  m->device = device;
  m->gpu = mem;
  m->iova = iova;
  m->length = length;
  m->access = access;
  m->mapped = mapped;
  m->mappedLength = mappedLength;
  m->mr.context = pd->context;
  m->mr.pd = pd;
  m->mr.addr = reinterpret_cast<void*>(iova);
  m->mr.length = length;
  const uint32_t key = h.newKey();
  m->mr.lkey = key;
  m->mr.rkey = key;
  m->mr.handle = key;
  h.mrs()[key] = m;
  ++m->pd->mrs;
  if (device) {
    // In tandemd's log: the GPU path of the double is what ran (tests look for this line).
    std::fprintf(stderr, "verbs double: registered GPU %d memory [%p, +%zu) as MR 0x%x (iova 0x%llx)\n",
                 mem.ordinal, static_cast<void*>(host), length, key, static_cast<unsigned long long>(iova));
  }
  return &m->mr;
}

ibv_mr* ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  return registerMr(pd, static_cast<uint8_t*>(addr), length, toIova(addr), access, nullptr, 0);
}

ibv_mr* ibv_reg_mr_iova(ibv_pd* pd, void* addr, size_t length, uint64_t iova, int access) {
  return registerMr(pd, static_cast<uint8_t*>(addr), length, iova, access, nullptr, 0);
}

ibv_mr* ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t iova, unsigned int access) {
  return registerMr(pd, static_cast<uint8_t*>(addr), length, iova,
                    static_cast<int>(access & ~static_cast<unsigned>(IBV_ACCESS_RELAXED_ORDERING)), nullptr, 0);
}

ibv_mr* ibv_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access) {
  if (fd < 0 || length == 0) {
    errno = EINVAL;
    return nullptr;
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t base = offset & ~(page - 1);
  const size_t mapLength = static_cast<size_t>(offset - base + length);
  void* p = ::mmap(nullptr, mapLength, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(base));
  if (p == MAP_FAILED) {
    // A CUDA dma-buf cannot be mapped: the double runs in the registrant's process, so it takes iova for the CUDA
    // VA of the fd's bytes (as tandem passes it) if that is GPU memory. Otherwise mmap's errno: memory it cannot reach.
    const int err = errno;
    return registerMr(pd, reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(iova)), length, iova,
                      access & ~IBV_ACCESS_RELAXED_ORDERING, nullptr, 0, err ? err : ENODEV);
  }
  ibv_mr* mr = registerMr(pd, static_cast<uint8_t*>(p) + (offset - base), length, iova,
                          access & ~IBV_ACCESS_RELAXED_ORDERING, p, mapLength);
  if (mr == nullptr) {
    const int err = errno;
    ::munmap(p, mapLength);
    errno = err;
  }
  return mr;
}

int ibv_dereg_mr(ibv_mr* mr) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Mr* m = mrOf(mr);
  h.mrs().erase(m->mr.lkey);
  --m->pd->mrs;
  if (m->mapped) ::munmap(m->mapped, m->mappedLength);
  if (m->device) {
    std::fprintf(stderr, "verbs double: deregistered MR 0x%x (GPU %d memory): %llu bytes copied into it, %llu out\n",
                 m->mr.lkey, m->gpu.ordinal, static_cast<unsigned long long>(m->bytesIn),
                 static_cast<unsigned long long>(m->bytesOut));
  }
  delete m;
  return 0;
}

ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cqContext, ibv_comp_channel* channel, int) {
  if (cqe < 1 || cqe > kMaxCqe || channel != nullptr) {
    errno = channel ? EOPNOTSUPP : EINVAL;
    return nullptr;
  }
  auto* c = new Cq;
  c->cq.context = ctx;
  c->cq.cq_context = cqContext;
  c->cq.cqe = cqe;
  c->capacity = cqe;
  pthread_mutex_init(&c->cq.mutex, nullptr);
  pthread_cond_init(&c->cq.cond, nullptr);
  return &c->cq;
}

int ibv_destroy_cq(ibv_cq* cq) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Cq* c = cqOf(cq);
  if (c->qps > 0) return EBUSY;
  pthread_mutex_destroy(&c->cq.mutex);
  pthread_cond_destroy(&c->cq.cond);
  delete c;
  return 0;
}

ibv_qp* ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* init) {
  if (pd == nullptr || init == nullptr || init->send_cq == nullptr || init->recv_cq == nullptr) {
    errno = EINVAL;
    return nullptr;
  }
  if (init->qp_type != IBV_QPT_RC || init->srq != nullptr) {
    errno = EOPNOTSUPP;  // the double has RC QPs only, without SRQs
    return nullptr;
  }
  const ibv_qp_cap& c = init->cap;
  if (c.max_send_wr == 0 || c.max_send_wr > static_cast<uint32_t>(kMaxQpWr) ||
      c.max_recv_wr > static_cast<uint32_t>(kMaxQpWr) || c.max_send_sge > static_cast<uint32_t>(kMaxSge) ||
      c.max_recv_sge > static_cast<uint32_t>(kMaxSge) || c.max_inline_data > kMaxInline) {
    errno = EINVAL;
    return nullptr;
  }
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  auto* q = new Qp;
  q->pd = pdOf(pd);
  q->scq = cqOf(init->send_cq);
  q->rcq = cqOf(init->recv_cq);
  q->cap = c;
  q->cap.max_recv_wr = std::max<uint32_t>(c.max_recv_wr, 1);
  q->cap.max_send_sge = std::max<uint32_t>(c.max_send_sge, 1);
  q->cap.max_recv_sge = std::max<uint32_t>(c.max_recv_sge, 1);
  q->sigAll = init->sq_sig_all != 0;
  init->cap = q->cap;  // what the QP really got, as providers report it
  q->qp.context = pd->context;
  q->qp.qp_context = init->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = init->send_cq;
  q->qp.recv_cq = init->recv_cq;
  q->qp.qp_num = h.newQpn();
  q->qp.handle = q->qp.qp_num;
  q->qp.state = IBV_QPS_RESET;
  q->qp.qp_type = IBV_QPT_RC;
  pthread_mutex_init(&q->qp.mutex, nullptr);
  pthread_cond_init(&q->qp.cond, nullptr);
  h.qps()[q->qp.qp_num] = q;
  ++q->pd->qps;
  ++q->scq->qps;
  ++q->rcq->qps;
  return &q->qp;
}

int ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  if (qp == nullptr || attr == nullptr) return EINVAL;
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  return modifyQp(*qpOf(qp), *attr, mask);
}

int ibv_query_qp(ibv_qp* qp, ibv_qp_attr* attr, int, ibv_qp_init_attr* init) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  const Qp& q = *qpOf(qp);
  std::memset(attr, 0, sizeof *attr);
  attr->qp_state = q.hw;
  attr->cur_qp_state = q.hw;
  attr->path_mtu = q.pathMtu;
  attr->dest_qp_num = q.destQpn;
  attr->qp_access_flags = q.accessFlags;
  attr->cap = q.cap;
  if (init) {
    std::memset(init, 0, sizeof *init);
    init->send_cq = q.qp.send_cq;
    init->recv_cq = q.qp.recv_cq;
    init->cap = q.cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = q.sigAll;
  }
  return 0;
}

int ibv_destroy_qp(ibv_qp* qp) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  Qp* q = qpOf(qp);
  h.resetQp(*q);
  h.qps().erase(q->qp.qp_num);
  --q->pd->qps;
  --q->scq->qps;
  --q->rcq->qps;
  pthread_mutex_destroy(&q->qp.mutex);
  pthread_cond_destroy(&q->qp.cond);
  delete q;
  return 0;
}

const char* ibv_wc_status_str(ibv_wc_status status) {
  static const char* const kNames[] = {
      "success", "local length error", "local QP operation error", "local EE context operation error",
      "local protection error", "Work Request Flushed Error", "memory management operation error",
      "bad response error", "local access error", "remote invalid request error", "remote access error",
      "remote operation error", "transport retry counter exceeded", "RNR retry counter exceeded",
      "local RDD violation error", "remote invalid RD request", "operation aborted", "invalid EE context number",
      "invalid EE context state", "fatal error", "response timeout error", "general error", "TM error",
      "TM rendezvous incomplete"};
  const auto i = static_cast<size_t>(status);
  return i < sizeof kNames / sizeof kNames[0] ? kNames[i] : "unknown";
}

const char* ibv_port_state_str(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_NOP: return "PORT_NOP";
    case IBV_PORT_DOWN: return "PORT_DOWN";
    case IBV_PORT_INIT: return "PORT_INIT";
    case IBV_PORT_ARMED: return "PORT_ARMED";
    case IBV_PORT_ACTIVE: return "PORT_ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "PORT_ACTIVE_DEFER";
  }
  return "invalid state";
}

// ---- the double's own API ----

int tandem_verbs_double_set_faults(const char* spec) {
  Faults f;
  if (!parseFaults(spec, f)) return EINVAL;
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  h.faults = f;
  h.faultsFromApi = true;
  h.resetWriteCount();
  return 0;
}

void tandem_verbs_double_vanish(void) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  h.vanishLocked();
}

uint64_t tandem_verbs_double_counter(const char* name) {
  Hca& h = hca();
  std::lock_guard lock(h.mu);
  return h.counter(name ? name : "");
}

}  // extern "C"
