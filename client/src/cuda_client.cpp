#include "cuda_client.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <poll.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "tandem/common/error.hpp"
#include "tandem/kernels/preload.hpp"
#include "tandem/kernels/ag_gemm.hpp"
#include "tandem/kernels/allgather.hpp"
#include "tandem/kernels/gemm_ar.hpp"
#include "tandem/kernels/gemm_rs.hpp"

namespace tandem::client::gpu {
namespace {

namespace k = tandem::kernels;

void checkRt(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  fail(ErrorCode::kCuda, "{}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e));
}
void checkDrv(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  fail(ErrorCode::kCuda, "{}: {}", what, k::driverErrorName(r));
}

// Runs a scope on `device`, restoring the caller's current device afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    checkRt(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) checkRt(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

uint64_t opTimeoutNs() {
  const char* v = std::getenv("TANDEM_OP_TIMEOUT_MS");
  const uint64_t ms = (v != nullptr && *v != '\0') ? std::strtoull(v, nullptr, 10) : 60000;
  return (ms == 0 ? 60000 : ms) * 1'000'000ull;
}

CUdeviceptr devptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

uint64_t roundUp(uint64_t x, uint64_t unit) { return (x + unit - 1) / unit * unit; }

constexpr uint64_t kMatUnit = 64u << 10;     // the gemm-rs/ar fixed layout takes matrices in whole 64 KiB
constexpr uint64_t kGranularity = 2u << 20;  // tandemd rounds each workspace up to the cuMem granularity (2 MiB here)

// ag-gemm flag words of a layout whose matrices hold matBytes: 1/512 of them (1.6% more bytes), enough for the chunk
// flags of any gathered A that fills the two data matrices with k >= 32.
uint64_t agFlagWordsFor(uint64_t matBytes) { return matBytes / 512; }

// Bytes after the AllGather region of a layout whose matrices hold matBytes.
uint64_t gemmAreaBytes(uint64_t matBytes, uint32_t nranks) {
  return roundUp(agFlagWordsFor(matBytes) * 8, kMatUnit) +
         k::gemmRsFixedWorkspaceBytes(static_cast<int64_t>(matBytes), static_cast<int>(nranks)) + 2 * matBytes;
}

k::GemmDtype gemmDtype(DType t) { return t == DType::kF16 ? k::GemmDtype::kFp16 : k::GemmDtype::kBf16; }

// The plan gemm-rs/ar runs for this shape: chosen here once, used both to size the workspace and to launch.
k::GemmRsPlan gemmReducePlan(const OpDescriptor& d) {
  const auto m = static_cast<int64_t>(d.dims[dim::kM]), n = static_cast<int64_t>(d.dims[dim::kN]);
  const auto k = static_cast<int64_t>(d.dims[dim::kK]);
  const int ranks = static_cast<int>(d.nranks);
  return d.kind == OpKind::kGemmAr ? k::chooseGemmArPlan(m, n, k, ranks, gemmDtype(d.dtype))
                                   : k::chooseGemmRsPlan(m, n, k, ranks, gemmDtype(d.dtype));
}

// A reduce-scatter in which some rank owns no rows runs with ranks kept in step by the daemon (gang-ready: op e starts
// only once every rank's stream reached it), because its kernels alone do not (gemm_rs.hpp: gemmRsRanksInStep).
// NOTE: the daemon applies the same rule (cuda_backend.cpp, needsGang); both must agree.
bool needsGang(const OpDescriptor& d) {
  return (d.kind == OpKind::kNop && d.nranks > 1) ||
         (d.kind == OpKind::kGemmRs &&
          !k::gemmRsRanksInStep(static_cast<int64_t>(d.dims[dim::kM]), static_cast<int>(d.nranks), false));
}

// Which plan ran, once per (op, shape) and process, on stderr when TANDEM_LOG=debug (libtandem has no logger and must
// not write to an application's stderr otherwise).
void logPlanOnce(const OpDescriptor& d, const std::string& plan) {
  static const bool enabled = [] {
    const char* v = std::getenv("TANDEM_LOG");
    return v != nullptr && std::strcmp(v, "debug") == 0;
  }();
  if (!enabled) return;
  static std::mutex mu;
  static std::set<std::string> seen;
  const std::string shape = fmt::format("{} {} m={} n={} k={} on {} ranks", opKindName(d.kind), dtypeName(d.dtype),
                                        d.dims[dim::kM], d.dims[dim::kN], d.dims[dim::kK], d.nranks);
  std::lock_guard lock(mu);
  if (seen.insert(shape).second) std::fprintf(stderr, "tandem: rank %u: %s: plan %s\n", d.rank, shape.c_str(), plan.c_str());
}

}  // namespace

// ---- workspace layout ---------------------------------------------------------------------------------------

WorkspaceLayout WorkspaceLayout::fit(uint64_t bytes, uint32_t nranks) {
  const uint64_t base = k::workspaceBytes(nranks);
  const uint64_t room = bytes > base ? bytes - base : 0;
  // The largest matrix size whose area fits; the area grows with it, so bisect over 64 KiB units (lo fits, hi not).
  uint64_t lo = 0, hi = room / 2 / kMatUnit + 1;
  while (hi - lo > 1) {
    const uint64_t mid = (lo + hi) / 2;
    (gemmAreaBytes(mid * kMatUnit, nranks) <= room ? lo : hi) = mid;
  }
  WorkspaceLayout l;
  l.rsMatBytes = lo * kMatUnit;
  l.agFlagsOff = base;
  l.agFlagWords = agFlagWordsFor(l.rsMatBytes);
  l.rsOff = base + roundUp(l.agFlagWords * 8, kMatUnit);
  l.dataOff = l.rsOff + k::gemmRsFixedWorkspaceBytes(static_cast<int64_t>(l.rsMatBytes), static_cast<int>(nranks));
  l.dataBytes = 2 * l.rsMatBytes;
  return l;
}

uint64_t WorkspaceLayout::bytesFor(uint64_t matBytes, uint32_t nranks) {
  return roundUp(k::workspaceBytes(nranks) + gemmAreaBytes(roundUp(matBytes, kMatUnit), nranks), kGranularity);
}

int currentDevice() {
  int d = 0;
  checkRt(cudaGetDevice(&d), "cudaGetDevice (is a CUDA device visible to this process?)");
  return d;
}

std::string deviceUuid(int ordinal) {
  cudaDeviceProp prop{};
  checkRt(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  return fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                     b[15]);
}

// ---- cuMem import -----------------------------------------------------------------------------------------

std::unique_ptr<DeviceMapping> DeviceMapping::import(const Fd& fd, uint64_t bytes, int accessDevice) {
  const auto& d = k::driver();
  DeviceScope scope(accessDevice);
  checkRt(cudaFree(nullptr), "CUDA context initialisation");
  CUmemGenericAllocationHandle h = 0;
  checkDrv(d.memImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
           "cuMemImportFromShareableHandle (tandemd's allocation)");
  std::unique_ptr<DeviceMapping> m(new DeviceMapping());
  m->size_ = bytes;
  CUdeviceptr va = 0;
  CUresult r = d.memAddressReserve(&va, bytes, 0, 0, 0);
  if (r == CUDA_SUCCESS) {
    r = d.memMap(va, bytes, 0, h, 0);
    if (r != CUDA_SUCCESS) d.memAddressFree(va, bytes);
  }
  d.memRelease(h);  // the mapping holds the allocation from here on
  checkDrv(r, "cuMemMap (tandemd's allocation)");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = accessDevice;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.memSetAccess(va, bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.memUnmap(va, bytes);
    d.memAddressFree(va, bytes);
    checkDrv(r, "cuMemSetAccess (is peer access possible between this GPU and the memory's?)");
  }
  m->va_ = va;
  return m;
}

DeviceMapping::~DeviceMapping() {
  if (va_ == 0) return;
  const auto& d = k::driver();
  d.memUnmap(va_, size_);
  d.memAddressFree(va_, size_);
}

// ---- registration -----------------------------------------------------------------------------------------

RegisterDescription describeForRegister(void* ptr, uint64_t bytes, int fd, uint64_t fdOffset) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess || attr.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    fail(ErrorCode::kInvalidArgument, "tandem_register: {} is not GPU memory (tandemd runs the cuda backend); pass "
         "memory from cudaMalloc, or from cuMemCreate with its POSIX fd", ptr);
  }
  RegisterDescription out;
  out.deviceUuid = deviceUuid(attr.device);
  if (fd >= 0) {
    out.kind = 2;
    out.offset = fdOffset;
    return out;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  checkDrv(k::driver().memGetAddressRange(&base, &size, devptr(ptr)), "cuMemGetAddressRange");
  const uint64_t offset = devptr(ptr) - base;
  if (bytes > size - offset) {
    fail(ErrorCode::kInvalidArgument, "tandem_register: [{}, +{}) runs past the end of its {}-byte allocation", ptr,
         bytes, size);
  }
  cudaIpcMemHandle_t h;
  const cudaError_t ie = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
  if (ie != cudaSuccess) {
    cudaGetLastError();
    fail(ErrorCode::kInvalidArgument, "tandem_register: no CUDA IPC handle for {} ({}). cuMem (VMM) memory has none: "
         "create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and pass that fd and the offset of ptr in it",
         ptr, cudaGetErrorString(ie));
  }
  out.kind = 1;
  out.ipcHandle.assign(reinterpret_cast<const char*>(&h), sizeof h);
  out.offset = offset;
  return out;
}

// ---- communicators ----------------------------------------------------------------------------------------

namespace {
// Every kernel libtandem may launch, once per device.
void preloadEverything(int device) {
  static std::mutex mu;
  static std::set<int> done;
  std::lock_guard lock(mu);
  if (done.contains(device)) return;
  k::preloadRuntimeKernels(device);
  k::preloadGemmKernels(device);
  k::preloadAgGemmKernels(device);
  k::preloadGemmRsKernels(device);
  k::preloadGemmArKernels(device);
  done.insert(device);
}
}  // namespace

CommGpu::Mode CommGpu::modeOf(const std::string& executor) {
  if (executor == "client") return Mode::kClient;
  if (executor == "daemon") return Mode::kDaemon;
  if (executor == "host") return Mode::kHost;
  fail(ErrorCode::kProtocol, "tandemd answered the join with executor '{}', which this libtandem does not know "
       "(client, daemon, host); use the libtandem of tandemd's release", executor);
}

CommGpu::CommGpu(int device, Mode mode, uint32_t rank, uint32_t nranks, uint32_t maxCtas, Fd control,
                 uint64_t controlBytes, std::vector<std::unique_ptr<DeviceMapping>> workspaces)
    : device_(device), mode_(mode), rank_(rank), nranks_(nranks), maxCtas_(maxCtas), controlFd_(std::move(control)),
      controlBytes_(controlBytes), workspaces_(std::move(workspaces)), timeoutNs_(opTimeoutNs()) {
  workspaceBytes_ = workspaces_.empty() ? 0 : workspaces_[0]->size();
  for (const auto& w : workspaces_) workspaceBytes_ = std::min(workspaceBytes_, w->size());
  if (mode_ != Mode::kHost) layout_ = WorkspaceLayout::fit(workspaceBytes_, nranks_);
  if (controlBytes_ < sizeof(k::CommControl)) {
    fail(ErrorCode::kProtocol, "tandemd sent a {}-byte control page; this libtandem needs {}", controlBytes_,
         sizeof(k::CommControl));
  }
  controlMap_ = ::mmap(nullptr, controlBytes_, PROT_READ | PROT_WRITE, MAP_SHARED, controlFd_.get(), 0);
  if (controlMap_ == MAP_FAILED) {
    controlMap_ = nullptr;
    checkErrno(-1, "mmap(control page)");
  }
  ctl_ = static_cast<k::CommControl*>(controlMap_);
  DeviceScope scope(device_);
  // Before any op: a kernel loaded lazily behind one of our own stream waits would hang (preload.hpp). In host mode
  // libtandem launches no kernel.
  try {
    if (mode_ != Mode::kHost) preloadEverything(device_);
  } catch (const std::exception& e) {
    fail(ErrorCode::kCuda, "communicator init on device {}: {}", device_, e.what());
  }
  checkRt(cudaHostRegister(controlMap_, controlBytes_, cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister(control page)");
  registered_ = true;
  void* dev = nullptr;
  checkRt(cudaHostGetDevicePointer(&dev, controlMap_, 0), "cudaHostGetDevicePointer(control page)");
  ctlDev_ = static_cast<k::CommControl*>(dev);
}

CommGpu::~CommGpu() {
  if (registered_) {
    cudaHostUnregister(controlMap_);
    cudaGetLastError();
  }
  if (controlMap_ != nullptr) ::munmap(controlMap_, controlBytes_);
}

char* CommGpu::workspace(uint32_t r, uint64_t offset) const {
  return static_cast<char*>(workspaces_[r]->ptr()) + offset;
}

uint64_t CommGpu::matBytesNeeded(const OpDescriptor& d) const {
  if (nranks_ == 1) return 0;  // one rank exchanges nothing: its kernels touch no workspace
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], kk = d.dims[dim::kK];
  if (d.kind == OpKind::kAgGemm) {
    // Gathered A [m, k] in the two data matrices; its chunk flags in the flag words (1/512 of a matrix).
    const auto words = static_cast<uint64_t>(k::agGemmFlagWords(static_cast<int64_t>(m), static_cast<int>(nranks_)));
    return std::max(m * kk, 512 * words);
  }
  const bool allReduce = d.kind == OpKind::kGemmAr;
  uint64_t need = static_cast<uint64_t>(
      k::gemmRsMatBytesNeeded(static_cast<int64_t>(m), static_cast<int64_t>(n), gemmReducePlan(d)));
  if (k::gemmRsWritesPeerOutputs(static_cast<int64_t>(m), static_cast<int>(nranks_), allReduce)) {
    // The output [rows, n] (16-bit) in the two data matrices; rank 0's rows, the most, so that every rank decides alike.
    need = std::max(need, (allReduce ? m : rowsOf(m, 0, nranks_)) * n);
  }
  return need;
}

void CommGpu::check(const OpDescriptor& d, const DevicePointers& ptrs) const {
  const std::string_view op = opKindName(d.kind);
  if (mode_ == Mode::kHost) {
    // tandemd stages the op through host memory and runs it with the cpu backend's code: any dtype, any alignment,
    // no workspace.
    switch (d.kind) {
      case OpKind::kNop:
      case OpKind::kAllGather:
      case OpKind::kAgGemm:
      case OpKind::kGemmRs:
      case OpKind::kGemmAr: return;
      default:
        fail(ErrorCode::kUnsupported, "{}: this communicator's ranks live on several nodes, and across nodes tandem "
             "runs ag-gemm, gemm-rs, gemm-ar, allgather and barriers only; run {} on a communicator whose ranks are all "
             "on one node", op, op);
    }
  }
  switch (d.kind) {
    case OpKind::kNop:
    case OpKind::kAllGather: return;
    case OpKind::kAgGemm:
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: break;
    default:
      fail(ErrorCode::kUnsupported, "{}: the cuda backend does not run this op yet (it runs ag-gemm, gemm-rs, gemm-ar, "
           "allgather and barriers); run it on a tandemd with daemon.backend: cpu", op);
  }
  if (mode_ == Mode::kDaemon) {
    fail(ErrorCode::kUnsupported, "{}: tandemd runs executor daemon, whose persistent kernel cannot run the fused GEMM "
         "kernels (each needs every SM of the GPU, one co-resident CTA per SM, while the persistent kernel keeps SMs "
         "of its own and runs work items inside its own small grid); set daemon.executor: client in tandemd's config",
         op);
  }
  if (d.dtype != DType::kBF16 && d.dtype != DType::kF16) {
    fail(ErrorCode::kUnsupported, "{}: the cuda backend's GEMM kernels take bf16 or fp16, not {}; convert the "
         "tensors, or run {} on a tandemd with daemon.backend: cpu", op, dtypeName(d.dtype), dtypeName(d.dtype));
  }
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], kk = d.dims[dim::kK];
  if (n % 8 != 0) {
    fail(ErrorCode::kInvalidArgument, "{}: n = {} is not a multiple of 8; the cuda backend's kernels move whole "
         "16-byte rows (tensor memory accelerator), so pad n to a multiple of 8", op, n);
  }
  if (kk % 8 != 0) {
    fail(ErrorCode::kInvalidArgument, "{}: {} = {} is not a multiple of 8; the cuda backend's kernels move whole "
         "16-byte rows, so pad K with zeros{}", op, d.kind == OpKind::kAgGemm ? "k" : "this rank's k slice", kk,
         d.kind == OpKind::kAgGemm ? "" : " (and split it so that every rank's slice is a multiple of 8)");
  }
  constexpr uint64_t kMaxDim = uint64_t{1} << 31;  // the kernels index rows and columns with int32
  if (m >= kMaxDim || n >= kMaxDim || kk >= kMaxDim) {
    fail(ErrorCode::kInvalidArgument, "{}: m = {}, n = {} and k = {} must each be below 2^31 on the cuda backend", op, m,
         n, kk);
  }
  static constexpr const char* kSlotNames[] = {"a", "b", "c", "a_gathered"};
  for (std::size_t s = 0; s < std::size(kSlotNames); ++s) {
    if (ptrs[s] != nullptr && reinterpret_cast<uintptr_t>(ptrs[s]) % 16 != 0) {
      fail(ErrorCode::kInvalidArgument, "{}: tensor {} starts at {}, which is not 16-byte aligned; the cuda backend's "
           "kernels read and write 16 bytes at a time: use an offset that is a multiple of 16", op, kSlotNames[s],
           ptrs[s]);
    }
  }
  const uint64_t need = roundUp(matBytesNeeded(d), kMatUnit);
  if (need > layout_.rsMatBytes) {
    const uint64_t bytes = WorkspaceLayout::bytesFor(need, nranks_);
    fail(ErrorCode::kInvalidArgument, "{}: m = {}, n = {}, k = {} on {} ranks needs a workspace of {} bytes ({} MiB) "
         "per rank, but this communicator's is {} bytes; set cuda.workspace_bytes: {} (or more) in tandemd's config "
         "(default 512 MiB) and restart it, or split the op", op, m, n, kk,
         nranks_, bytes, (bytes + (1u << 20) - 1) >> 20, workspaceBytes_, bytes);
  }
}

void CommGpu::enqueue(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  const auto& drv = k::driver();
  const auto s = static_cast<CUstream>(stream);
  const auto e32 = static_cast<uint32_t>(e);
  DeviceScope scope(device_);
  const auto write = [&](k::StreamWord& w, const char* what) {
    checkDrv(drv.streamWriteValue32(s, devptr(&w.value), e32, CU_STREAM_WRITE_VALUE_DEFAULT), what);
  };
  const auto waitFor = [&](k::StreamWord& w, const char* what) {
    checkDrv(drv.streamWaitValue32(s, devptr(&w.value), e32, CU_STREAM_WAIT_VALUE_GEQ), what);
  };
  if (mode_ != Mode::kClient) {
    // kDaemon: the daemon's kernel runs the op once every rank's stream got here (gang-ready), then writes done;
    // check() let only allgather and barriers through. kHost: tandemd runs the op once every local rank's stream got
    // here (the inputs are final), staged through host memory, then writes done.
    write(ctlDev_->ready, "cuStreamWriteValue32(ready)");
    waitFor(ctlDev_->done, "cuStreamWaitValue32(done)");
    return;
  }
  // Client executor: the daemon opens go once every rank submitted the op (for a gang, once every rank's stream
  // reached it and wrote ready); the kernels run; done tells the daemon the op finished on this rank.
  if (d.kind == OpKind::kNop && nranks_ == 1) {
    // Nothing to meet: the stream need not wait for the daemon's go (the daemon still validates and completes it).
    write(ctlDev_->done, "cuStreamWriteValue32(done)");
    return;
  }
  if (needsGang(d)) write(ctlDev_->ready, "cuStreamWriteValue32(ready)");
  waitFor(ctlDev_->go, "cuStreamWaitValue32(go)");
  try {
    switch (d.kind) {
      case OpKind::kNop: break;
      case OpKind::kAllGather: launchAllGather(d, ptrs, e, stream); break;
      case OpKind::kAgGemm: logPlanOnce(d, launchAgGemm(d, ptrs, e, stream)); break;
      case OpKind::kGemmRs:
      case OpKind::kGemmAr: logPlanOnce(d, launchGemmReduce(d, ptrs, e, stream)); break;
      default: fail(ErrorCode::kInternal, "{} reached the cuda enqueue unchecked", opKindName(d.kind));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& ex) {  // the launchers throw std::runtime_error
    fail(ErrorCode::kCuda, "{}: {}", opKindName(d.kind), ex.what());
  }
  write(ctlDev_->done, "cuStreamWriteValue32(done)");
}

void CommGpu::launchAllGather(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  k::AllGatherParams p{};
  p.send = ptrs[slot::kSend];
  p.recv = ptrs[slot::kRecv];
  p.bytes = d.dims[dim::kBytes];
  p.epoch = e;
  p.timeoutNs = timeoutNs_;
  for (uint32_t r = 0; r < nranks_; ++r) p.workspaces[r] = workspaces_[r]->ptr();
  p.ctl = ctlDev_;
  p.rank = rank_;
  p.nranks = nranks_;
  const k::AgTuning t = k::allgatherTuning(p.bytes, maxCtas_);
  p.chunkBytes = t.chunkBytes;
  p.numCtas = t.numCtas;
  p.mode = t.mode;
  p.checkVerdict = 1;  // a rejected op is skipped inside the kernel
  k::launchAllGather(p, static_cast<cudaStream_t>(stream));
}

// The fields AgGemmParams and GemmRsParams share: this rank, the shape, the dtype and the operands.
template <class Params>
void fillGemmCommon(Params& p, const OpDescriptor& d, const DevicePointers& ptrs, uint32_t rank, uint32_t nranks) {
  p.rank = static_cast<int32_t>(rank);
  p.nranks = static_cast<int32_t>(nranks);
  p.m = static_cast<int64_t>(d.dims[dim::kM]);
  p.n = static_cast<int64_t>(d.dims[dim::kN]);
  p.k = static_cast<int64_t>(d.dims[dim::kK]);
  p.dtype = gemmDtype(d.dtype);
  p.a = ptrs[slot::kA];
  p.b = ptrs[slot::kB];
}

// The fused GEMMs cannot skip an op the daemon rejected (nothing in them reads the verdict): the daemon aborts the
// communicator instead, so they find the abort word set and unwind (cuda_backend.cpp, release). Every wait reports
// into this rank's control page (errorSlot) and polls its abort word, as AllGather's do.
std::string CommGpu::launchAgGemm(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  k::AgGemmParams p{};
  fillGemmCommon(p, d, ptrs, rank_, nranks_);
  p.c = ptrs[slot::kC];
  void* const userGathered = ptrs[slot::kAGathered];
  if (nranks_ == 1) {
    p.aGathered = userGathered;  // the local plan copies the shard there (or skips it when absent)
  } else {
    // Peers push their shards into our gathered buffer, so it lives in the workspace (the caller's buffers are
    // mapped in this process only).
    p.aGathered = workspace(rank_, layout_.dataOff);
    p.flags = reinterpret_cast<uint64_t*>(workspace(rank_, layout_.agFlagsOff));
    p.flagWords = static_cast<int64_t>(layout_.agFlagWords);
    for (uint32_t q = 0; q < nranks_; ++q) {
      p.peerGathered[q] = workspace(q, layout_.dataOff);
      p.peerFlags[q] = reinterpret_cast<uint64_t*>(workspace(q, layout_.agFlagsOff));
    }
  }
  p.epoch = e;
  p.abortWord = &ctlDev_->abort;
  p.errorSlot = &ctlDev_->error;
  p.timeoutNs = timeoutNs_;
  const k::AgGemmPlanChoice plan = k::launchAgGemm(p, s);  // plan 0: the launcher chooses
  std::string name = k::agGemmPlanName(plan.plan);
  if (plan.plan == k::AgGemmPlan::kFused) {
    name += fmt::format(" ({} comm SMs, {} copies, {} tail tiles)", plan.commSms, plan.commMode == 2 ? "TMA" : "LSU",
                        plan.tailTiles);
  } else if (plan.plan == k::AgGemmPlan::kDecomposed) {
    name += fmt::format(" ({} all-gather CTAs, then the GEMM)", plan.commSms);
  }
  if (nranks_ > 1 && userGathered != nullptr) {
    // Cost: m * k * 2 bytes read and written once more, after the GEMM (the gathered A exists only in the workspace).
    checkRt(cudaMemcpyAsync(userGathered, p.aGathered, static_cast<size_t>(p.m * p.k * 2), cudaMemcpyDeviceToDevice, s),
            "cudaMemcpyAsync(gathered A into a_gathered)");
    name += ", a_gathered copied out of the workspace";
  }
  return name;
}

std::string CommGpu::launchGemmReduce(const OpDescriptor& d, const DevicePointers& ptrs, uint64_t e, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const bool allReduce = d.kind == OpKind::kGemmAr;
  k::GemmRsParams p{};
  fillGemmCommon(p, d, ptrs, rank_, nranks_);
  p.lda = p.k;
  p.ldb = p.k;
  p.ldOut = p.n;
  // Reduced rows that go into another rank's output must land in memory that rank's peers have mapped: its workspace.
  // Cost (gemm-ar on 2+ ranks, gemm-rs where a tile row spans two ranks): this rank's output is read and written once
  // more after the kernel, rows * n * 2 bytes (about 0.1 ms for 8192 x 8192 bf16 at ~3 TB/s, next to a ~1 ms op).
  const bool staged = k::gemmRsWritesPeerOutputs(p.m, p.nranks, allReduce);
  void* const userOut = ptrs[slot::kC];
  p.out = staged ? workspace(rank_, layout_.dataOff) : userOut;
  for (uint32_t q = 0; q < nranks_; ++q) {
    p.workspace[q] = workspace(q, layout_.rsOff);
    if (q != rank_) p.peerOut[q] = workspace(q, layout_.dataOff);  // written only when staged
  }
  p.wsMatBytes = static_cast<int64_t>(layout_.rsMatBytes);
  // Read only when wsMatBytes is 0 (a workspace too small for any exchange), which check() allows for one rank alone,
  // whose kernel stages nothing.
  p.wsMaxM = p.m;
  p.wsMaxN = p.n;
  p.epoch = e;
  p.abortWord = &ctlDev_->abort;
  p.errorSlot = &ctlDev_->error;
  p.timeoutNs = timeoutNs_;
  p.plan = gemmReducePlan(d);  // the plan check() sized the workspace for
  const k::GemmRsPlan ran = allReduce ? k::launchGemmAr(p, s) : k::launchGemmRs(p, s);
  std::string name = k::gemmRsPlanName(ran, allReduce);
  if (staged) {
    const uint64_t rows = allReduce ? d.dims[dim::kM] : rowsOf(d.dims[dim::kM], rank_, nranks_);
    if (rows > 0) {
      checkRt(cudaMemcpyAsync(userOut, p.out, rows * d.dims[dim::kN] * 2, cudaMemcpyDeviceToDevice, s),
              "cudaMemcpyAsync(output out of the workspace)");
    }
    name += ", output staged in the workspace and copied out";
  }
  return name;
}

void CommGpu::abortLocal() {
  // Kernels poll the abort word; stream waits compare cyclically, so go and done jump far past every epoch.
  std::atomic_ref<uint64_t>(ctl_->abort).store(k::kAbortValue, std::memory_order_release);
  const auto lead = static_cast<uint32_t>(epoch + k::kStreamAbortLead);
  std::atomic_ref<uint32_t>(ctl_->go.value).store(lead, std::memory_order_release);
  std::atomic_ref<uint32_t>(ctl_->done.value).store(lead, std::memory_order_release);
}

// ---- the daemon watcher -----------------------------------------------------------------------------------

SessionWatch::SessionWatch(int socketFd) : socketFd_(socketFd), stop_(Fd::eventfd()) {
  thread_ = std::thread([this] { run(); });
}

SessionWatch::~SessionWatch() {
  signalEventfd(stop_.get());
  if (thread_.joinable()) thread_.join();
}

void SessionWatch::add(const std::shared_ptr<CommGpu>& comm) {
  std::lock_guard lock(mutex_);
  std::erase_if(comms_, [](const std::weak_ptr<CommGpu>& w) { return w.expired(); });
  comms_.push_back(comm);
  if (lost_) comm->abortLocal();
}

void SessionWatch::run() {
  for (;;) {
    // POLLRDHUP only: replies (POLLIN) belong to Session::call; a hang-up or error is reported regardless.
    pollfd p[2] = {{socketFd_, POLLRDHUP, 0}, {stop_.get(), POLLIN, 0}};
    const int n = ::poll(p, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (p[1].revents != 0) return;
    if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) break;
  }
  std::lock_guard lock(mutex_);
  lost_ = true;
  for (auto& w : comms_) {
    if (auto c = w.lock()) {
      std::lock_guard cl(c->mutex);
      c->abortLocal();
    }
  }
}

}  // namespace tandem::client::gpu
