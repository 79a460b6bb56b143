#include "cuda/daemon_executor.hpp"

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "cuda/gpu.hpp"
#include "tandem/common/error.hpp"
#include "tandem/kernels/fused_ops.hpp"
#include "tandem/kernels/preload.hpp"

namespace tandem::daemon::cuda {
namespace {

using kernels::KernelState;

constexpr uint64_t kIdleShrinkNs = 200'000;  // the grid shrinks to one CTA after 200 µs without work

uint64_t loadSc(const uint64_t& word) { return std::atomic_ref<const uint64_t>(word).load(std::memory_order_seq_cst); }
void storeSc(uint64_t& word, uint64_t v) { std::atomic_ref<uint64_t>(word).store(v, std::memory_order_seq_cst); }

}  // namespace

GpuExecutor::GpuExecutor(int device, uint32_t numCtas, uint64_t lingerNs)
    : device_(device), numCtas_(numCtas), lingerNs_(lingerNs) {
  useDevice(device_);
  kernels::preloadRuntimeKernels(device_);  // never loaded lazily behind a waiting stream (preload.hpp)
  kernels::preloadFusedGemmKernels(device_);
  checkRuntime(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  void* q = nullptr;
  checkRuntime(cudaHostAlloc(&q, sizeof(kernels::WorkQueue), cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc(work queue)");
  std::memset(q, 0, sizeof(kernels::WorkQueue));
  queue_ = static_cast<kernels::WorkQueue*>(q);
  void* st = nullptr;
  checkRuntime(cudaMalloc(&st, sizeof(kernels::PersistentDeviceState)), "cudaMalloc(executor state)");
  state_ = static_cast<kernels::PersistentDeviceState*>(st);
  // Generation 0, exited: the first push launches.
  storeSc(queue_->phase, static_cast<uint64_t>(KernelState::kExited));
}

GpuExecutor::~GpuExecutor() {
  stop();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (state_ != nullptr) cudaFree(state_);
  if (queue_ != nullptr) cudaFreeHost(queue_);
  cudaGetLastError();
}

uint32_t GpuExecutor::freeSlots() const {
  const uint64_t consumed = loadSc(queue_->consumed);
  return kernels::kWorkQueueCapacity - static_cast<uint32_t>(tail_ - consumed);
}

void GpuExecutor::launch() {
  ++generation_;
  storeSc(queue_->phase, (generation_ << 8) | static_cast<uint64_t>(KernelState::kLaunching));
  kernels::PersistentParams p{};
  void* dq = nullptr;
  checkRuntime(cudaHostGetDevicePointer(&dq, queue_, 0), "cudaHostGetDevicePointer(work queue)");
  p.queue = static_cast<kernels::WorkQueue*>(dq);
  p.state = state_;
  p.generation = generation_;
  p.idleShrinkNs = kIdleShrinkNs;
  p.lingerNs = lingerNs_;
  useDevice(device_);
  try {
    kernels::launchPersistent(p, numCtas_, stream_);
  } catch (const std::exception& e) {
    fail(ErrorCode::kCuda, "GPU {}: {}", device_, e.what());
  }
}

void GpuExecutor::push(const kernels::WorkItem& item, std::shared_ptr<void> keepAlive) {
  kernels::WorkItem& slot = queue_->items[tail_ % kernels::kWorkQueueCapacity];
  std::memcpy(static_cast<void*>(&slot), &item, sizeof item);
  live_.emplace_back(tail_, std::move(keepAlive));
  ++tail_;
  // release (seq_cst): publishes the item; the kernel's ldAcquireSys of tail pairs with it. seq_cst also orders
  // this store before the phase load below (Dekker with the kernel's fence.sc between its phase store and tail load).
  storeSc(queue_->tail, tail_);
  if (relaunch_) {  // the last kernel left for an exclusive run: a fresh one, stream-ordered after that run
    relaunch_ = false;
    launch();
    return;
  }
  for (;;) {
    const uint64_t phase = loadSc(queue_->phase);
    const uint64_t gen = phase >> 8;
    const auto state = static_cast<KernelState>(phase & 0xff);
    if (gen < generation_ || state == KernelState::kLaunching || state == KernelState::kFull) return;
    if (state == KernelState::kShrinking || state == KernelState::kExiting) {
      std::this_thread::yield();  // the kernel is deciding; it re-reads tail within a microsecond
      continue;
    }
    if (state == KernelState::kSolo && item.needsGrid == 0) return;  // the lone CTA runs it
    // kSolo with a big item (the lone CTA leaves it and exits), or kExited: a fresh full grid, stream-ordered
    // after the old kernel.
    launch();
    return;
  }
}

void GpuExecutor::runExclusive(const std::function<void(cudaStream_t)>& enqueue, std::shared_ptr<void> keepAlive) {
  if (generation_ != 0 && !relaunch_) {
    kernels::WorkItem y{};
    y.kind = kernels::WorkKind::kYield;
    push(y, nullptr);
  }
  relaunch_ = true;
  useDevice(device_);
  enqueue(stream_);
  cudaEvent_t ev = nullptr;
  checkRuntime(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  const cudaError_t e = cudaEventRecord(ev, stream_);
  if (e != cudaSuccess) {
    cudaEventDestroy(ev);
    checkRuntime(e, "cudaEventRecord");
  }
  exclusive_.emplace_back(ev, std::move(keepAlive));
}

void GpuExecutor::poll() {
  while (!exclusive_.empty() && cudaEventQuery(exclusive_.front().first) == cudaSuccess) {
    cudaEventDestroy(exclusive_.front().first);
    exclusive_.pop_front();
  }
  if (live_.empty()) return;
  const uint64_t finished = std::atomic_ref<const uint64_t>(queue_->finished).load(std::memory_order_acquire);
  while (!live_.empty() && live_.front().first < finished) live_.pop_front();
}

bool GpuExecutor::healthy(std::string* why) const {
  if (generation_ == 0 || stopped_) return true;
  const cudaError_t e = cudaStreamQuery(stream_);
  if (e == cudaSuccess || e == cudaErrorNotReady) return true;
  if (why != nullptr) *why = fmt::format("GPU {}: the persistent kernel failed: {} ({})", device_, cudaGetErrorName(e),
                                         cudaGetErrorString(e));
  return false;
}

void GpuExecutor::stop() {
  if (stopped_ || queue_ == nullptr) return;
  stopped_ = true;
  storeSc(queue_->stop, 1);
  useDevice(device_);
  const cudaError_t e = cudaStreamSynchronize(stream_);
  if (e != cudaSuccess) spdlog::warn("GPU {}: the persistent kernel ended with {}", device_, cudaGetErrorString(e));
  cudaGetLastError();
  live_.clear();
  for (auto& [ev, keep] : exclusive_) cudaEventDestroy(ev);
  exclusive_.clear();
}

}  // namespace tandem::daemon::cuda
