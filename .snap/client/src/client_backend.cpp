// The cpu backend's client strategy, the refusal of a libtandem built without CUDA, and the choice between them and
// the cuda strategy (cuda_client.cpp): see client_backend.hpp.
#include "client_backend.hpp"

#include <string_view>

#include "tandem/common/error.hpp"
#ifdef TANDEM_HAVE_CUDA
#include "cuda_client.hpp"
#endif

namespace tandem::client {
namespace {

// The daemon's memfd, mapped MAP_SHARED.
class SharedMemory final : public BufferMemory {
 public:
  explicit SharedMemory(Mapping mapping) : mapping_(std::move(mapping)) {}
  void* ptr() const override { return mapping_.data(); }

 private:
  Mapping mapping_;
};

// The cpu backend's communicator rank: tandemd runs the op; the rank only submits it.
class CpuCommExecutor final : public CommExecutor {
 public:
  void submit(const OpDescriptor& /*desc*/, const TensorPointers& /*ptrs*/, void* /*stream*/,
              const std::function<void()>& submitToDaemon, const std::function<void()>& /*abortComm*/) override {
    submitToDaemon();
  }
  void setPlan(const PlanKey& /*key*/, const PlanChoice& /*plan*/) override {}
};

class CpuBackend : public ClientBackend {
 public:
  int prepareAllocate(v1::AllocateBuffer& /*request*/) const override { return -1; }
  std::unique_ptr<BufferMemory> mapAllocation(const Fd& fd, const v1::AllocateBufferReply& reply,
                                              int /*device*/) const override {
    return std::make_unique<SharedMemory>(Mapping::shared(fd.get(), reply.bytes()));
  }
  bool sharesRegistrations() const override { return false; }
  void describeRegistration(v1::RegisterBuffer& request, void* /*ptr*/, uint64_t bytes, int fd,
                            uint64_t fdOffset) const override {
    if (fd < 0) {
      fail(ErrorCode::kInvalidArgument, "tandem_register needs the memfd that backs ptr (cpu backend); pass it as fd");
    }
    request.set_offset(fdOffset);
    request.set_bytes(bytes);
  }
  int prepareJoin(v1::JoinCommunicator& /*join*/) const override { return -1; }
  std::size_t joinFds() const override { return 0; }
  std::unique_ptr<CommExecutor> attach(Session& /*session*/, uint64_t /*handle*/, uint32_t /*rank*/,
                                       uint32_t /*nranks*/, const v1::JoinCommunicatorReply& /*reply*/,
                                       std::vector<Fd>& /*fds*/, int /*device*/) override {
    return std::make_unique<CpuCommExecutor>();
  }
  std::string executorName(const v1::JoinCommunicatorReply& /*reply*/) const override { return "cpu"; }
  void close() override {}
};

#ifndef TANDEM_HAVE_CUDA
// tandemd runs the cuda backend, but this libtandem cannot: whatever needs CUDA fails, naming the call and the remedy.
class NoCudaBackend final : public CpuBackend {
 public:
  int prepareAllocate(v1::AllocateBuffer& /*request*/) const override { refuse("tandem_alloc"); }
  bool sharesRegistrations() const override { return false; }
  void describeRegistration(v1::RegisterBuffer& /*request*/, void* /*ptr*/, uint64_t /*bytes*/, int /*fd*/,
                            uint64_t /*fdOffset*/) const override {
    refuse("tandem_register");
  }
  int prepareJoin(v1::JoinCommunicator& /*join*/) const override { refuse("tandem_comm_init"); }

 private:
  [[noreturn]] static void refuse(std::string_view call) {
    fail(ErrorCode::kUnsupported, "{}: tandemd runs the cuda backend, but this libtandem was built without CUDA (nvcc "
         "was not found when it was configured); rebuild libtandem with the CUDA toolkit", call);
  }
};
#endif

}  // namespace

std::unique_ptr<ClientBackend> makeClientBackend(const Session& session) {
  if (session.backend() != "cuda") return std::make_unique<CpuBackend>();
#ifdef TANDEM_HAVE_CUDA
  return gpu::makeCudaBackend(session.socketFd());
#else
  return std::make_unique<NoCudaBackend>();
#endif
}

}  // namespace tandem::client
