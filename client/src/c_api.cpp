// The stable C ABI over client::Session. Every entry point catches, records the message for
// tandem_last_error(), and returns a status code; nothing throws across the boundary.
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "session.hpp"
#ifdef TANDEM_HAVE_CUDA
#include "cuda_client.hpp"
namespace gpu = tandem::client::gpu;
#endif
#include "tandem/common/paths.hpp"
#include "tandem/common/validate.hpp"
#include "tandem/tandem.h"

using tandem::Error;
using tandem::ErrorCode;
using tandem::fail;

struct tandem_buffer;

struct tandem_session {
  std::unique_ptr<tandem::client::Session> impl;
  bool cuda = false;  // the daemon runs the cuda backend: buffers are GPU memory, ops are stream-ordered
#ifdef TANDEM_HAVE_CUDA
  std::unique_ptr<gpu::SessionWatch> watch;  // aborts every stream's waits when tandemd dies
#endif
  std::mutex registrationMutex;
  std::map<std::pair<uintptr_t, uint64_t>, tandem_buffer*> registrations;  // cuda: (ptr, bytes) -> buffer
};

struct tandem_buffer {
  tandem_session_t session;
  uint64_t id;
  uint64_t bytes;
  bool registered;
  tandem::Mapping mapping;  // cpu allocations: our mapping of the daemon's memfd
  void* userPtr;            // registrations: the caller's memory
#ifdef TANDEM_HAVE_CUDA
  std::unique_ptr<gpu::DeviceMapping> device;  // cuda allocations: the daemon's cuMem memory, mapped here
#endif
  int refs = 1;  // cuda registrations of the same range share one buffer
};

struct tandem_comm {
  tandem_session_t session;
  uint64_t handle;
  uint32_t rank;
  uint32_t nranks;
#ifdef TANDEM_HAVE_CUDA
  std::shared_ptr<gpu::CommGpu> gpu;  // cuda: control page, workspaces, epochs
#endif
};

namespace {

thread_local std::string lastError;

tandem_status_t record(ErrorCode code, const std::string& message) {
  lastError = message;
  return static_cast<tandem_status_t>(tandem::wireCode(code));
}

template <typename F>
tandem_status_t guarded(F&& body) {
  try {
    lastError.clear();
    body();
    return TANDEM_SUCCESS;
  } catch (const Error& e) {
    return record(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return record(ErrorCode::kOutOfMemory, "out of host memory in libtandem");
  } catch (const std::exception& e) {
    return record(ErrorCode::kInternal, e.what());
  }
}

void require(bool ok, const char* what) {
  if (!ok) fail(ErrorCode::kInvalidArgument, "{}", what);
}

[[maybe_unused]] constexpr const char* kNoCuda =
    "tandemd runs the cuda backend, but this libtandem was built without CUDA (nvcc was not found when it was "
    "configured); rebuild libtandem with the CUDA toolkit";

tandem::BufferRef ref(tandem_session_t session, const tandem_tensor_t& t, const tandem::SlotRule& rule) {
  if (t.buffer == nullptr) return {0, 0, rule.bytes};
  if (t.buffer->session != session) {
    fail(ErrorCode::kInvalidArgument, "tensor {} lives in a buffer of another session; use buffers of the session "
         "the communicator belongs to", rule.name);
  }
  return {t.buffer->id, t.offset, rule.bytes};
}

// Rolls back a half-finished call (the daemon already created something the client could not set up). The
// original error is what the caller needs to see, so a failure of the rollback itself is dropped.
void undoQuietly(tandem_session_t session, tandem::v1::Request& undo) {
  try {
    session->impl->call(undo);
  } catch (...) {
  }
}

// Fills every slot's BufferRef from the tensors, validates the descriptor as the daemon will, and submits. cuda
// backend: also checks that this rank's GPU can run the op (before submitting: a refused op changes nothing), then
// enqueues its stream work on `stream` (a cudaStream_t; null = the legacy default stream).
tandem_status_t submitOp(tandem_comm_t comm, tandem::OpDescriptor desc, std::initializer_list<tandem_tensor_t> tensors,
                         tandem_op_t* op, [[maybe_unused]] void* stream = nullptr) {
  return guarded([&] {
    require(comm != nullptr && op != nullptr, "comm and op must not be NULL");
    desc.version = tandem::kDescriptorVersion;
    desc.rank = comm->rank;
    desc.nranks = comm->nranks;
    desc.commHandle = comm->handle;
    const tandem::SlotRules rules = tandem::expectedSlots(desc);
    std::size_t i = 0;
    for (const tandem_tensor_t& t : tensors) {
      desc.bufs[i] = ref(comm->session, t, rules[i]);
      if (t.buffer == nullptr && !rules[i].optional && rules[i].bytes > 0) {
        fail(ErrorCode::kInvalidArgument, "{}: tensor {} is required but its buffer is NULL", tandem::opKindName(desc.kind),
             rules[i].name);
      }
      if (t.buffer == nullptr) desc.bufs[i].bytes = 0;
      ++i;
    }
    tandem::validateDescriptor(desc);
    for (std::size_t s = 0; s < i; ++s) {
      const tandem_tensor_t& t = tensors.begin()[s];
      if (t.buffer != nullptr && (t.offset > t.buffer->bytes || desc.bufs[s].bytes > t.buffer->bytes - t.offset)) {
        fail(ErrorCode::kInvalidArgument, "{}: tensor {} needs bytes [{}, {}) but its buffer holds {} bytes; pass a "
             "larger buffer or a smaller offset", tandem::opKindName(desc.kind), rules[s].name, t.offset,
             t.offset + desc.bufs[s].bytes, t.buffer->bytes);
      }
    }
#ifdef TANDEM_HAVE_CUDA
    if (comm->gpu) {
      gpu::DevicePointers ptrs{};
      for (std::size_t s = 0; s < i; ++s) {
        const tandem_tensor_t& t = tensors.begin()[s];
        if (t.buffer != nullptr) ptrs[s] = static_cast<char*>(tandem_buffer_ptr(t.buffer)) + t.offset;
      }
      comm->gpu->check(desc, ptrs);
      // Ring order = epoch order = stream order: one submitter at a time on this communicator.
      std::lock_guard lock(comm->gpu->mutex);
      op->session = comm->session;
      op->seq = comm->session->impl->submit(desc);
      const uint64_t epoch = ++comm->gpu->epoch;
      try {
        comm->gpu->enqueue(desc, ptrs, epoch, stream);
      } catch (...) {
        // The op is submitted but this rank's stream will not run it: abort the communicator, or the peers' kernels
        // would wait for ours until their deadline. The CUDA error is what the caller needs to see.
        tandem::v1::Request abort;
        abort.mutable_destroy_comm()->set_comm_handle(comm->handle);
        abort.mutable_destroy_comm()->set_abort(true);
        undoQuietly(comm->session, abort);
        throw;
      }
      return;
    }
#endif
    op->session = comm->session;
    op->seq = comm->session->impl->submit(desc);
  });
}

tandem::OpDescriptor descriptor(tandem::OpKind kind, tandem_dtype_t dtype) {
  tandem::OpDescriptor desc{};
  desc.kind = kind;
  desc.dtype = static_cast<tandem::DType>(dtype);
  return desc;
}

}  // namespace

extern "C" {

const char* tandem_strerror(tandem_status_t status) {
  switch (status) {
    case TANDEM_SUCCESS: return "success";
    case TANDEM_IN_PROGRESS: return "in progress";
    default: {
      static thread_local std::string name;
      name = std::string(tandem::errorCodeName(static_cast<ErrorCode>(status)));
      return name.c_str();
    }
  }
}

const char* tandem_last_error(void) { return lastError.c_str(); }
const char* tandem_version(void) { return TANDEM_VERSION_STRING; }
size_t tandem_dtype_size(tandem_dtype_t dtype) { return tandem::dtypeSize(static_cast<tandem::DType>(dtype)); }

tandem_status_t tandem_connect(const char* socket_path, tandem_session_t* out) {
  return guarded([&] {
    require(out != nullptr, "out must not be NULL");
    const std::string path = socket_path != nullptr ? socket_path : tandem::defaultSocketPath(true);
    auto session = std::make_unique<tandem_session>();
    session->impl = tandem::client::Session::connect(path);
    session->cuda = session->impl->backend() == "cuda";
#ifdef TANDEM_HAVE_CUDA
    if (session->cuda) session->watch = std::make_unique<gpu::SessionWatch>(session->impl->socketFd());
#endif
    *out = session.release();
  });
}

tandem_status_t tandem_disconnect(tandem_session_t session) {
  delete session;  // closing the socket ends the session; the daemon reclaims everything
  return TANDEM_SUCCESS;
}

const char* tandem_session_backend(tandem_session_t session) {
  return session != nullptr ? session->impl->backend().c_str() : "";
}

tandem_status_t tandem_alloc(tandem_session_t session, uint64_t bytes, tandem_buffer_t* out) {
  return guarded([&] {
    require(session != nullptr && out != nullptr, "session and out must not be NULL");
    tandem::v1::Request request;
    request.mutable_allocate()->set_bytes(bytes);
    [[maybe_unused]] int device = -1;
    if (session->cuda) {
#ifdef TANDEM_HAVE_CUDA
      device = gpu::currentDevice();
      request.mutable_allocate()->set_device_uuid(gpu::deviceUuid(device));
#else
      fail(ErrorCode::kUnsupported, "tandem_alloc: {}", kNoCuda);
#endif
    }
    std::vector<tandem::Fd> fds;
    const auto response = session->impl->call(request, {}, &fds, 1);
    auto buffer = std::make_unique<tandem_buffer>();
    buffer->session = session;
    buffer->id = response.allocate().buffer_id();
    buffer->bytes = response.allocate().bytes();
    buffer->registered = false;
    buffer->userPtr = nullptr;
    try {
#ifdef TANDEM_HAVE_CUDA
      if (session->cuda) {
        buffer->device = gpu::DeviceMapping::import(fds[0], response.allocate().mapped_bytes(), device);
      } else
#endif
      {
        buffer->mapping = tandem::Mapping::shared(fds[0].get(), buffer->bytes);
      }
    } catch (...) {
      tandem::v1::Request undo;
      undo.mutable_free()->set_buffer_id(buffer->id);
      undoQuietly(session, undo);
      throw;
    }
    *out = buffer.release();
  });
}

static tandem_status_t releaseBuffer(tandem_buffer_t buffer, bool registered) {
  return guarded([&] {
    require(buffer != nullptr, "buffer must not be NULL");
    std::unique_ptr<tandem_buffer> owned(buffer);
    tandem::v1::Request request;
    if (registered) {
      request.mutable_deregister()->set_buffer_id(buffer->id);
    } else {
      request.mutable_free()->set_buffer_id(buffer->id);
    }
    buffer->session->impl->call(request);
  });
}

tandem_status_t tandem_free(tandem_buffer_t buffer) {
  if (buffer != nullptr && buffer->registered) {
    return record(ErrorCode::kInvalidArgument, "this buffer was registered; release it with tandem_deregister");
  }
  return releaseBuffer(buffer, false);
}

tandem_status_t tandem_deregister(tandem_buffer_t buffer) {
  if (buffer != nullptr && !buffer->registered) {
    return record(ErrorCode::kInvalidArgument, "this buffer was allocated; release it with tandem_free");
  }
  if (buffer != nullptr && buffer->session->cuda) {
    std::lock_guard lock(buffer->session->registrationMutex);
    if (--buffer->refs > 0) return TANDEM_SUCCESS;  // another registration of the same range still holds it
    std::erase_if(buffer->session->registrations, [&](const auto& kv) { return kv.second == buffer; });
  }
  return releaseBuffer(buffer, true);
}

void* tandem_buffer_ptr(tandem_buffer_t buffer) {
  if (buffer == nullptr) return nullptr;
  if (buffer->registered) return buffer->userPtr;
#ifdef TANDEM_HAVE_CUDA
  if (buffer->device) return buffer->device->ptr();
#endif
  return buffer->mapping.data();
}

uint64_t tandem_buffer_size(tandem_buffer_t buffer) { return buffer != nullptr ? buffer->bytes : 0; }

tandem_status_t tandem_register(tandem_session_t session, void* ptr, uint64_t bytes, int fd, uint64_t fd_offset,
                                tandem_buffer_t* out) {
  return guarded([&] {
    require(session != nullptr && out != nullptr && ptr != nullptr, "session, ptr and out must not be NULL");
    if (session->cuda) {
#ifdef TANDEM_HAVE_CUDA
      std::lock_guard lock(session->registrationMutex);
      const auto key = std::make_pair(reinterpret_cast<uintptr_t>(ptr), bytes);
      if (auto it = session->registrations.find(key); it != session->registrations.end()) {
        ++it->second->refs;  // the same range again: the same buffer (and id)
        *out = it->second;
        return;
      }
      const gpu::RegisterDescription d = gpu::describeForRegister(ptr, bytes, fd, fd_offset);
      tandem::v1::Request request;
      auto* reg = request.mutable_register_buffer();
      reg->set_offset(d.offset);
      reg->set_bytes(bytes);
      reg->set_kind(static_cast<tandem::v1::RegisterKind>(d.kind));
      reg->set_ipc_handle(d.ipcHandle);
      reg->set_device_uuid(d.deviceUuid);
      const int fds[] = {fd};
      const auto response = session->impl->call(request, fd >= 0 ? std::span<const int>(fds) : std::span<const int>());
      auto buffer = std::make_unique<tandem_buffer>();
      buffer->session = session;
      buffer->id = response.register_buffer().buffer_id();
      buffer->bytes = bytes;
      buffer->registered = true;
      buffer->userPtr = ptr;
      session->registrations[key] = buffer.get();
      *out = buffer.release();
      return;
#else
      fail(ErrorCode::kUnsupported, "tandem_register: {}", kNoCuda);
#endif
    }
    require(fd >= 0, "tandem_register needs the memfd that backs ptr (cpu backend); pass it as fd");
    tandem::v1::Request request;
    request.mutable_register_buffer()->set_offset(fd_offset);
    request.mutable_register_buffer()->set_bytes(bytes);
    const int fds[] = {fd};
    const auto response = session->impl->call(request, fds);
    auto buffer = std::make_unique<tandem_buffer>();
    buffer->session = session;
    buffer->id = response.register_buffer().buffer_id();
    buffer->bytes = bytes;
    buffer->registered = true;
    buffer->userPtr = ptr;
    *out = buffer.release();
  });
}

tandem_status_t tandem_get_unique_id(tandem_unique_id_t* out) {
  return guarded([&] {
    require(out != nullptr, "out must not be NULL");
    std::size_t got = 0;
    while (got < sizeof out->bytes) {
      const ssize_t n = ::getrandom(out->bytes + got, sizeof out->bytes - got, 0);
      if (n < 0 && errno == EINTR) continue;
      tandem::checkErrno(n, "getrandom");
      got += static_cast<std::size_t>(n);
    }
  });
}

tandem_status_t tandem_comm_init(tandem_session_t session, const tandem_unique_id_t* id, uint32_t nranks,
                                 uint32_t rank, uint32_t timeout_ms, tandem_comm_t* out) {
  return guarded([&] {
    require(session != nullptr && id != nullptr && out != nullptr, "session, id and out must not be NULL");
    tandem::v1::Request request;
    auto* join = request.mutable_join_comm();
    join->set_unique_id(std::string(reinterpret_cast<const char*>(id->bytes), sizeof id->bytes));
    join->set_nranks(nranks);
    join->set_rank(rank);
    join->set_timeout_ms(timeout_ms);
    [[maybe_unused]] int device = -1;
    if (session->cuda) {
#ifdef TANDEM_HAVE_CUDA
      device = gpu::currentDevice();
      join->set_device_uuid(gpu::deviceUuid(device));
#else
      fail(ErrorCode::kUnsupported, "tandem_comm_init: {}", kNoCuda);
#endif
    }
    // The daemon enforces the rendezvous timeout; our own only guards against a daemon that stops answering.
    const int64_t waitMs = (timeout_ms == 0 ? 300000 : int64_t{timeout_ms}) + 5000;
    std::vector<tandem::Fd> fds;
    const auto response = session->impl->call(request, {}, &fds, session->cuda ? 1 : 0, waitMs);
    auto comm = std::make_unique<tandem_comm>();
    comm->session = session;
    comm->handle = response.join_comm().comm_handle();
    comm->rank = rank;
    comm->nranks = nranks;
#ifdef TANDEM_HAVE_CUDA
    if (session->cuda) {
      try {
        const auto& j = response.join_comm();
        const gpu::CommGpu::Mode mode = gpu::CommGpu::modeOf(j.executor());
        // Map every rank's workspace (ours included) with access for our GPU; a communicator that spans nodes (host
        // mode) has none.
        std::vector<std::unique_ptr<gpu::DeviceMapping>> workspaces;
        for (uint32_t r = 0; mode != gpu::CommGpu::Mode::kHost && r < nranks; ++r) {
          tandem::v1::Request m;
          m.mutable_comm_mapping()->set_comm_handle(comm->handle);
          m.mutable_comm_mapping()->set_rank(r);
          std::vector<tandem::Fd> wsFd;
          const auto reply = session->impl->call(m, {}, &wsFd, 1);
          workspaces.push_back(gpu::DeviceMapping::import(wsFd[0], reply.comm_mapping().bytes(), device));
        }
        comm->gpu = std::make_shared<gpu::CommGpu>(device, mode, rank, nranks, j.comm_ctas(),
                                                   std::move(fds[0]), j.control_bytes(), std::move(workspaces));
        session->watch->add(comm->gpu);
      } catch (...) {
        tandem::v1::Request undo;
        undo.mutable_destroy_comm()->set_comm_handle(comm->handle);
        undoQuietly(session, undo);
        throw;
      }
    }
#endif
    *out = comm.release();
  });
}

static tandem_status_t endComm(tandem_comm_t comm, bool abort) {
  return guarded([&] {
    require(comm != nullptr, "comm must not be NULL");
    tandem::v1::Request request;
    request.mutable_destroy_comm()->set_comm_handle(comm->handle);
    request.mutable_destroy_comm()->set_abort(abort);
    comm->session->impl->call(request);
  });
}

tandem_status_t tandem_comm_abort(tandem_comm_t comm) { return endComm(comm, true); }

tandem_status_t tandem_comm_destroy(tandem_comm_t comm) {
  std::unique_ptr<tandem_comm> owned(comm);
  const tandem_status_t status = endComm(comm, false);
  // After an abort or a lost peer the daemon may already have dropped us; the handle is freed regardless.
  return status == TANDEM_ERROR_NOT_FOUND ? TANDEM_SUCCESS : status;
}

uint32_t tandem_comm_rank(tandem_comm_t comm) { return comm != nullptr ? comm->rank : 0; }
uint32_t tandem_comm_nranks(tandem_comm_t comm) { return comm != nullptr ? comm->nranks : 0; }

tandem_status_t tandem_wait(tandem_op_t op, int64_t timeout_ms) {
  if (op.session == nullptr) return record(ErrorCode::kInvalidArgument, "op has no session (was it submitted?)");
  tandem::client::OpResult r;
  const tandem_status_t s = guarded([&] { r = op.session->impl->wait(op.seq, timeout_ms); });
  if (s != TANDEM_SUCCESS) return s;
  return r.code == ErrorCode::kOk ? TANDEM_SUCCESS : record(r.code, r.message);
}

tandem_status_t tandem_op_status(tandem_op_t op, char* message, size_t message_len) {
  if (op.session == nullptr) return record(ErrorCode::kInvalidArgument, "op has no session (was it submitted?)");
  tandem::client::OpResult r;
  const tandem_status_t s = guarded([&] { r = op.session->impl->status(op.seq); });
  if (s != TANDEM_SUCCESS) return s;
  if (message != nullptr && message_len > 0) {
    const std::size_t n = std::min(message_len - 1, r.message.size());
    std::memcpy(message, r.message.data(), n);
    message[n] = '\0';
  }
  if (r.code == ErrorCode::kInProgress) return TANDEM_IN_PROGRESS;
  return r.code == ErrorCode::kOk ? TANDEM_SUCCESS : record(r.code, r.message);
}

// ---- ops ---------------------------------------------------------------------------------------------

#define TANDEM_CHECK_ARGS(args, type)                                                                  \
  if ((args) == nullptr || (args)->struct_size < sizeof(type))                                         \
    return record(ErrorCode::kInvalidArgument, "args is NULL or args->struct_size is not sizeof(" #type ")");

tandem_status_t tandem_ag_gemm(tandem_comm_t comm, const tandem_ag_gemm_args_t* args, tandem_op_t* op) {
  TANDEM_CHECK_ARGS(args, tandem_ag_gemm_args_t)
  auto desc = descriptor(tandem::OpKind::kAgGemm, args->dtype);
  desc.dims[0] = args->m, desc.dims[1] = args->n, desc.dims[2] = args->k;
  return submitOp(comm, desc, {args->a, args->b, args->c, args->a_gathered}, op, args->cuda_stream);
}

static tandem_status_t gemmReduce(tandem::OpKind kind, tandem_comm_t comm, const tandem_gemm_rs_args_t* args,
                                  tandem_op_t* op) {
  TANDEM_CHECK_ARGS(args, tandem_gemm_rs_args_t)
  auto desc = descriptor(kind, args->dtype);
  desc.dims[0] = args->m, desc.dims[1] = args->n, desc.dims[2] = args->k;
  return submitOp(comm, desc, {args->a, args->b, args->c}, op, args->cuda_stream);
}

tandem_status_t tandem_gemm_rs(tandem_comm_t comm, const tandem_gemm_rs_args_t* args, tandem_op_t* op) {
  return gemmReduce(tandem::OpKind::kGemmRs, comm, args, op);
}

tandem_status_t tandem_gemm_ar(tandem_comm_t comm, const tandem_gemm_ar_args_t* args, tandem_op_t* op) {
  return gemmReduce(tandem::OpKind::kGemmAr, comm, args, op);
}

tandem_status_t tandem_moe_dispatch_gemm(tandem_comm_t comm, const tandem_moe_dispatch_gemm_args_t* args,
                                         tandem_op_t* op) {
  TANDEM_CHECK_ARGS(args, tandem_moe_dispatch_gemm_args_t)
  auto desc = descriptor(tandem::OpKind::kMoeDispatchGemm, args->dtype);
  desc.dims = {args->tokens, args->hidden, args->n_out, args->experts, args->topk, args->capacity, 0, 0};
  return submitOp(comm, desc,
                  {args->x, args->topk_ids, args->topk_weights, args->w, args->out, args->row_info, args->expert_counts},
                  op, args->cuda_stream);
}

tandem_status_t tandem_moe_dispatch_ffn_combine(tandem_comm_t comm, const tandem_moe_ffn_args_t* args, tandem_op_t* op) {
  TANDEM_CHECK_ARGS(args, tandem_moe_ffn_args_t)
  auto desc = descriptor(tandem::OpKind::kMoeDispatchFfnCombine, args->dtype);
  desc.dims = {args->tokens, args->hidden, args->ffn, args->experts, args->topk, 0, 0, 0};
  return submitOp(comm, desc, {args->x, args->topk_ids, args->topk_weights, args->w1, args->w2, args->out}, op,
                  args->cuda_stream);
}

tandem_status_t tandem_ring_attention(tandem_comm_t comm, const tandem_ring_attention_args_t* args, tandem_op_t* op) {
  TANDEM_CHECK_ARGS(args, tandem_ring_attention_args_t)
  auto desc = descriptor(tandem::OpKind::kRingAttention, args->dtype);
  desc.dims[0] = args->seq, desc.dims[1] = args->heads, desc.dims[2] = args->head_dim;
  desc.flags = args->causal ? tandem::kFlagCausal : 0;
  desc.scale = args->scale;
  return submitOp(comm, desc, {args->q, args->k, args->v, args->out}, op, args->cuda_stream);
}

tandem_status_t tandem_allgather(tandem_comm_t comm, tandem_tensor_t send, tandem_tensor_t recv, uint64_t bytes,
                                 void* cuda_stream, tandem_op_t* op) {
  auto desc = descriptor(tandem::OpKind::kAllGather, TANDEM_DTYPE_INVALID);
  desc.dims[0] = bytes;
  return submitOp(comm, desc, {send, recv}, op, cuda_stream);
}

tandem_status_t tandem_barrier_stream(tandem_comm_t comm, void* cuda_stream, tandem_op_t* op) {
  return submitOp(comm, descriptor(tandem::OpKind::kNop, TANDEM_DTYPE_INVALID), {}, op, cuda_stream);
}

tandem_status_t tandem_barrier(tandem_comm_t comm, tandem_op_t* op) {
  return tandem_barrier_stream(comm, nullptr, op);  // cuda: the legacy default stream
}

}  // extern "C"
