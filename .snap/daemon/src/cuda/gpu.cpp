#include "cuda/gpu.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "tandem/common/error.hpp"
#include "tandem/kernels/cuda_raii.hpp"
#include "tandem/kernels/driver.hpp"

namespace tandem::daemon::cuda {
namespace {

using kernels::checkCuda;
using kernels::CudaDeviceGuard;
using kernels::driver;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string stripPrefix(const std::string& s) {
  const std::string l = lower(s);
  return l.rfind("gpu-", 0) == 0 ? l.substr(4) : l;
}

// ---- NVML, optional: only for counting NVLink links between GPUs -----------------------------------------
// Declared here (nvml.h is not part of every toolkit install); the layout is NVML's nvmlPciInfo_t.
struct NvmlPciInfo {
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
};
using NvmlDevice = void*;

class Nvml {
 public:
  Nvml() {
    lib_ = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) return;
    init_ = reinterpret_cast<int (*)()>(::dlsym(lib_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<int (*)()>(::dlsym(lib_, "nvmlShutdown"));
    byUuid_ = reinterpret_cast<int (*)(const char*, NvmlDevice*)>(::dlsym(lib_, "nvmlDeviceGetHandleByUUID"));
    linkState_ = reinterpret_cast<int (*)(NvmlDevice, unsigned, int*)>(::dlsym(lib_, "nvmlDeviceGetNvLinkState"));
    remotePci_ = reinterpret_cast<int (*)(NvmlDevice, unsigned, NvmlPciInfo*)>(
        ::dlsym(lib_, "nvmlDeviceGetNvLinkRemotePciInfo_v2"));
    // Optional (older drivers lack them): without them links through an NVSwitch are not attributed to peers.
    remoteType_ = reinterpret_cast<int (*)(NvmlDevice, unsigned, int*)>(
        ::dlsym(lib_, "nvmlDeviceGetNvLinkRemoteDeviceType"));
    p2pStatus_ = reinterpret_cast<int (*)(NvmlDevice, NvmlDevice, int, int*)>(::dlsym(lib_, "nvmlDeviceGetP2PStatus"));
    ok_ = init_ && shutdown_ && byUuid_ && linkState_ && remotePci_ && init_() == 0;
  }
  ~Nvml() {
    if (ok_) shutdown_();
    if (lib_ != nullptr) ::dlclose(lib_);
  }
  bool ok() const { return ok_; }
  // Where a GPU's NVLinks go: to other GPUs directly (counted per PCI (domain, bus, device)), or to NVSwitches (HGX
  // boards: every link goes to a switch, and the GPU reaches every NVLink peer through all of them).
  struct Links {
    std::map<std::tuple<unsigned, unsigned, unsigned>, uint32_t> direct;
    uint32_t toSwitches = 0;
  };
  Links links(const std::string& uuid) const {
    Links out;
    NvmlDevice dev = nullptr;
    if (!ok_ || byUuid_(uuid.c_str(), &dev) != 0) return out;
    for (unsigned link = 0; link < 18; ++link) {
      int active = 0;
      if (linkState_(dev, link, &active) != 0 || active == 0) continue;
      int type = -1;
      if (remoteType_ != nullptr && remoteType_(dev, link, &type) == 0 && type == kNvLinkDeviceSwitch) {
        ++out.toSwitches;
        continue;
      }
      NvmlPciInfo pci{};
      if (remotePci_(dev, link, &pci) != 0) continue;
      ++out.direct[{pci.domain, pci.bus, pci.device}];
    }
    return out;
  }
  // Whether NVML says the two GPUs talk peer to peer over NVLink (directly or through switches).
  bool nvlinkPeers(const std::string& a, const std::string& b) const {
    NvmlDevice da = nullptr, db = nullptr;
    if (!ok_ || p2pStatus_ == nullptr || byUuid_(a.c_str(), &da) != 0 || byUuid_(b.c_str(), &db) != 0) return false;
    int status = -1;
    return p2pStatus_(da, db, kP2pCapsNvlink, &status) == 0 && status == kP2pStatusOk;
  }

 private:
  void* lib_ = nullptr;
  bool ok_ = false;
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*byUuid_)(const char*, NvmlDevice*) = nullptr;
  int (*linkState_)(NvmlDevice, unsigned, int*) = nullptr;
  int (*remotePci_)(NvmlDevice, unsigned, NvmlPciInfo*) = nullptr;
  int (*remoteType_)(NvmlDevice, unsigned, int*) = nullptr;
  int (*p2pStatus_)(NvmlDevice, NvmlDevice, int, int*) = nullptr;
  static constexpr int kNvLinkDeviceSwitch = 2;  // NVML_NVLINK_DEVICE_TYPE_SWITCH
  static constexpr int kP2pCapsNvlink = 2;       // NVML_P2P_CAPS_INDEX_NVLINK
  static constexpr int kP2pStatusOk = 0;         // NVML_P2P_STATUS_OK
};

std::tuple<unsigned, unsigned, unsigned> parseBusId(const std::string& id) {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  std::sscanf(id.c_str(), "%x:%x:%x.%x", &domain, &bus, &device, &function);
  return {domain, bus, device};
}

CUmemAllocationProp allocationProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

uint64_t granularity(const CUmemAllocationProp& prop) {
  size_t g = 0;
  checkCuda(driver().memGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity");
  return g == 0 ? (2u << 20) : g;
}

// Reserves, maps and grants access; on failure releases what it took.
void mapInto(CuMemAllocation& a, const std::vector<int>& access) {
  const auto& d = driver();
  checkCuda(d.memAddressReserve(&a.va, a.size, 0, 0, 0), "cuMemAddressReserve");
  if (CUresult r = d.memMap(a.va, a.size, 0, a.handle, 0); r != CUDA_SUCCESS) {
    d.memAddressFree(a.va, a.size);
    a.va = 0;
    checkCuda(r, "cuMemMap");
  }
  std::vector<CUmemAccessDesc> desc;
  for (int dev : access) {
    CUmemAccessDesc ad{};
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = dev;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc.push_back(ad);
  }
  if (CUresult r = d.memSetAccess(a.va, a.size, desc.data(), desc.size()); r != CUDA_SUCCESS) {
    d.memUnmap(a.va, a.size);
    d.memAddressFree(a.va, a.size);
    a.va = 0;
    checkCuda(r, "cuMemSetAccess");
  }
  a.address = a.va;
}

}  // namespace

// ---- devices ----------------------------------------------------------------------------------------------

bool sameUuid(const std::string& a, const std::string& b) { return stripPrefix(a) == stripPrefix(b); }

bool mpsControlReachable(std::string* pipeDir) {
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string dir = (env != nullptr && *env != '\0') ? env : "/tmp/nvidia-mps";
  if (pipeDir != nullptr) *pipeDir = dir;
  struct stat st{};
  return ::stat((dir + "/control").c_str(), &st) == 0;
}

std::vector<GpuInfo> discoverGpus(const std::vector<std::string>& only) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    fail(ErrorCode::kUnavailable, "daemon.backend is cuda, but no CUDA device is usable: {} ({}). Check nvidia-smi and "
         "CUDA_VISIBLE_DEVICES, or set daemon.backend: cpu", e == cudaSuccess ? "0 devices visible" : cudaGetErrorName(e),
         e == cudaSuccess ? "cudaGetDeviceCount" : cudaGetErrorString(e));
  }
  std::vector<GpuInfo> gpus;
  std::vector<std::string> visible;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    checkCuda(cudaGetDeviceProperties(&prop, i), "cudaGetDeviceProperties({})", i);
    GpuInfo g;
    g.ordinal = i;
    g.uuid = formatGpuUuid(prop.uuid.bytes);
    g.name = prop.name;
    g.sms = static_cast<uint32_t>(prop.multiProcessorCount);
    g.memoryBytes = prop.totalGlobalMem;
    g.ccMajor = static_cast<uint32_t>(prop.major);
    g.ccMinor = static_cast<uint32_t>(prop.minor);
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, i) == cudaSuccess) g.pciBusId = lower(bus);
    cudaGetLastError();
    int mps = 0;
    if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, i) == cudaSuccess) g.mps = mps != 0;
    cudaGetLastError();
    visible.push_back(g.uuid);
    const bool wanted = only.empty() || std::any_of(only.begin(), only.end(),
                                                    [&](const std::string& u) { return sameUuid(u, g.uuid); });
    if (wanted) gpus.push_back(std::move(g));
  }
  for (const auto& u : only) {
    if (std::none_of(visible.begin(), visible.end(), [&](const std::string& v) { return sameUuid(u, v); })) {
      std::string list;
      for (const auto& v : visible) list += (list.empty() ? "" : ", ") + v;
      fail(ErrorCode::kUnavailable, "cuda.devices lists {}, which is not visible to tandemd (visible: {}). Fix the "
           "UUID (nvidia-smi -L) or CUDA_VISIBLE_DEVICES", u, list);
    }
  }
  // Peer access between every pair we own, both directions; NVLink counts when NVML answers.
  const Nvml nvml;
  for (auto& g : gpus) {
    const auto links = nvml.links(g.uuid);
    for (const auto& peer : gpus) {
      if (peer.ordinal == g.ordinal) continue;
      GpuPeerInfo p;
      p.uuid = peer.uuid;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, g.ordinal, peer.ordinal);
      if (can != 0) {
        CudaDeviceGuard guard(g.ordinal);
        const cudaError_t pe = cudaDeviceEnablePeerAccess(peer.ordinal, 0);
        p.p2p = pe == cudaSuccess || pe == cudaErrorPeerAccessAlreadyEnabled;
        cudaGetLastError();
      }
      if (auto it = links.direct.find(parseBusId(peer.pciBusId)); it != links.direct.end()) {
        p.nvlinks = it->second;
      } else if (links.toSwitches != 0 && nvml.nvlinkPeers(g.uuid, peer.uuid)) {
        p.nvlinks = links.toSwitches;  // through the NVSwitches: every switch link carries traffic to this peer
      }
      g.peers.push_back(p);
    }
  }
  if (!nvml.ok() && gpus.size() > 1) spdlog::info("NVML is not available: NVLink link counts are reported as 0");
  return gpus;
}

// ---- cuMem ------------------------------------------------------------------------------------------------

CuMemAllocation::~CuMemAllocation() {
  try {
    std::optional<CudaDeviceGuard> guard;
    if (device >= 0) guard.emplace(device);  // any thread may drop the last reference
    const auto& d = driver();
    if (va != 0) {
      d.memUnmap(va, size);
      d.memAddressFree(va, size);
    }
    if (handle != 0) d.memRelease(handle);
  } catch (const std::exception& e) {
    spdlog::warn("releasing a cuMem allocation on GPU {}: {}", device, e.what());
  }
}

std::shared_ptr<CuMemAllocation> createExportable(int device, uint64_t bytes, const std::vector<int>& access,
                                                  Fd* exported) {
  CudaDeviceGuard guard(device);
  const CUmemAllocationProp prop = allocationProp(device);
  const uint64_t g = granularity(prop);
  auto a = std::make_shared<CuMemAllocation>();
  a->device = device;
  a->size = (bytes + g - 1) / g * g;
  const CUresult r = driver().memCreate(&a->handle, a->size, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    fail(ErrorCode::kOutOfMemory, "allocate {} bytes on GPU {}: the GPU is out of memory", a->size, device);
  }
  checkCuda(r, "cuMemCreate");
  int fd = -1;
  checkCuda(driver().memExportToShareableHandle(&fd, a->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle");
  *exported = Fd(fd);
  mapInto(*a, access);
  return a;
}

std::shared_ptr<CuMemAllocation> importFd(const Fd& fd, uint64_t bytes, const std::vector<int>& access) {
  auto a = std::make_shared<CuMemAllocation>();
  const CUresult r = driver().memImportFromShareableHandle(
      &a->handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    a->handle = 0;
    fail(ErrorCode::kInvalidArgument, "register: the fd is not a cuMem allocation exported as a POSIX fd ({}); create "
         "the memory with cuMemCreate and CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, or pass fd -1 for cudaMalloc "
         "memory", kernels::driverErrorName(r));
  }
  CUmemAllocationProp prop{};
  checkCuda(driver().memGetAllocationPropertiesFromHandle(&prop, a->handle), "cuMemGetAllocationPropertiesFromHandle");
  a->device = prop.location.id;
  CudaDeviceGuard guard(a->device);
  const uint64_t g = granularity(allocationProp(a->device));
  a->size = (bytes + g - 1) / g * g;
  mapInto(*a, access);
  return a;
}

// ---- legacy IPC ---------------------------------------------------------------------------------------------

struct IpcMapping {
  std::string key;
  void* base = nullptr;
  uint64_t size = 0;
  int device = -1;
  ~IpcMapping();
};

namespace {
std::mutex ipcMutex;
std::map<std::string, std::weak_ptr<IpcMapping>> ipcOpen;  // by handle bytes
}  // namespace

IpcMapping::~IpcMapping() {
  if (base != nullptr) {
    try {
      CudaDeviceGuard guard(device);
      kernels::reportRelease(cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle");
    } catch (const std::exception& e) {
      spdlog::warn("closing a CUDA IPC handle on GPU {}: {}", device, e.what());
    }
  }
  std::lock_guard lock(ipcMutex);
  if (auto it = ipcOpen.find(key); it != ipcOpen.end() && it->second.expired()) ipcOpen.erase(it);
}

std::shared_ptr<IpcImport> openIpc(const std::string& handleBytes, int device, uint64_t offset, uint64_t bytes) {
  if (handleBytes.size() != sizeof(cudaIpcMemHandle_t)) {
    fail(ErrorCode::kInvalidArgument, "register: a CUDA IPC handle is {} bytes, this one is {}",
         sizeof(cudaIpcMemHandle_t), handleBytes.size());
  }
  std::shared_ptr<IpcMapping> m;
  {
    std::lock_guard lock(ipcMutex);
    if (auto it = ipcOpen.find(handleBytes); it != ipcOpen.end()) m = it->second.lock();
  }
  if (!m) {
    CudaDeviceGuard guard(device);
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handleBytes.data(), sizeof h);
    void* base = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail(ErrorCode::kInvalidArgument, "register: the CUDA IPC handle could not be opened ({}: {}); pass memory from "
           "cudaMalloc of a live process, on the GPU named by its device UUID", cudaGetErrorName(e),
           cudaGetErrorString(e));
    }
    m = std::make_shared<IpcMapping>();
    m->key = handleBytes;
    m->base = base;
    m->device = device;
    CUdeviceptr rangeBase = 0;
    size_t rangeSize = 0;
    checkCuda(driver().memGetAddressRange(&rangeBase, &rangeSize, reinterpret_cast<CUdeviceptr>(base)),
              "cuMemGetAddressRange");
    m->size = rangeSize;
    std::lock_guard lock(ipcMutex);
    ipcOpen[handleBytes] = m;
  }
  if (offset > m->size || bytes > m->size - offset) {
    fail(ErrorCode::kInvalidArgument, "register: range [{}, {}) lies outside the {}-byte allocation of the IPC handle",
         offset, offset + bytes, m->size);
  }
  auto imp = std::make_shared<IpcImport>();
  imp->mapping = m;
  imp->device = m->device;
  imp->address = reinterpret_cast<uint64_t>(m->base) + offset;
  return imp;
}

}  // namespace tandem::daemon::cuda
