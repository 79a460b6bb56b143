// The C ABI over client::Session. Every entry point catches, records the message for tandem_last_error(), and
// returns a status code; nothing throws across the boundary.
//
// Lifetimes: the session handle, its buffers and its communicators share one SessionCore (reference counted), so a
// handle stays a valid object after tandem_disconnect. Every call on a handle holds the core's `life` lock shared;
// tandem_disconnect takes it exclusively, releases what every live handle holds (the core keeps a list of them),
// closes the connection and marks the core closed, so later calls fail with a message instead of touching released
// memory. Ops are plain values: they name their session by a serial that a process-wide registry maps to its core
// while it is open.
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "c_args.hpp"
#include "client_backend.hpp"
#include "plan_hook.hpp"
#include "session.hpp"
#include "submit.hpp"
#include "tandem/common/op_spec.hpp"
#include "tandem/common/paths.hpp"
#include "tandem/common/validate.hpp"
#include "tandem/tandem.h"

// tandem.h spells the protocol version for programs; libtandem and tandemd use tandem/common/protocol.hpp.
static_assert(TANDEM_PROTOCOL_VERSION == tandem::kProtocolVersion, "tandem.h and tandem/common/protocol.hpp disagree");

using tandem::Error;
using tandem::ErrorCode;
using tandem::fail;

namespace {

// "0.2.0" as TANDEM_VERSION_CODE computes it; -1 if it is not three dot-separated numbers.
constexpr int versionCodeOf(std::string_view v) {
  int parts[3] = {0, 0, 0};
  int i = 0;
  for (const char c : v) {
    if (c == '.') {
      if (++i > 2) return -1;
    } else if (c >= '0' && c <= '9') {
      parts[i] = parts[i] * 10 + (c - '0');
    } else {
      return -1;
    }
  }
  return i == 2 ? TANDEM_MAKE_VERSION_CODE(parts[0], parts[1], parts[2]) : -1;
}
static_assert(versionCodeOf(TANDEM_VERSION_STRING) == TANDEM_VERSION_CODE,
              "TANDEM_VERSION_MAJOR/MINOR/PATCH in tandem.h must equal project(tandem VERSION ...) in CMakeLists.txt");

}  // namespace

struct tandem_buffer;
struct tandem_comm;

namespace tandem::client {
// What a session and its handles share. Lock order: life, then handlesMutex or registrationMutex.
struct SessionCore {
  uint64_t serial = 0;  // process-unique, never reused: how tandem_op_t names its session
  std::unique_ptr<tandem::client::Session> impl;
  // tandemd's backend as this process sees it (cpu, cuda): buffers' memory, registration, communicator ranks.
  std::unique_ptr<tandem::client::ClientBackend> backend;
  // Shared by every call on the session or one of its handles; exclusive in tandem_disconnect, which therefore waits
  // for calls in flight and leaves no call half done on released state.
  std::shared_mutex life;
  bool closed = false;               // under life; set once by tandem_disconnect
  std::atomic<bool> closing{false};  // set by tandem_disconnect before it hangs up: in-flight failures then say why
  std::mutex handlesMutex;           // buffers and comms: calls holding life shared add and remove handles
  std::unordered_set<tandem_buffer*> buffers;
  std::unordered_set<tandem_comm*> comms;
  std::mutex registrationMutex;
  // Where the backend shares registrations of one range (sharesRegistrations): (ptr, bytes) -> buffer.
  std::map<std::pair<uintptr_t, uint64_t>, tandem_buffer*> registrations;
  // Eager ops of communicators whose graph replays can fail on their own (CommExecutor::replayFaultProbe): seq -> its
  // communicator's probe, called once the op's result is final, and then the result it gave (reportReplayFault).
  // Bounded, oldest dropped: a failure stays in its communicator until a later op's result takes it.
  struct ReplayProbe {
    std::function<std::string()> probe;
    std::optional<tandem::client::OpResult> result;  // set once the probe was asked: what this op reports from then on
  };
  std::mutex probesMutex;
  std::map<uint64_t, ReplayProbe> replayProbes;
};
}  // namespace tandem::client
using tandem::client::SessionCore;

struct tandem_session {
  std::shared_ptr<SessionCore> core;
};

struct tandem_buffer {
  std::shared_ptr<SessionCore> core;
  uint64_t id;
  uint64_t bytes;
  bool registered;
  std::unique_ptr<tandem::client::BufferMemory> memory;  // allocations: the daemon's memory, mapped here
  void* userPtr;                                         // registrations: the caller's memory
  int refs = 1;  // registrations of the same range share one buffer (where the backend shares them)
};

struct tandem_comm {
  std::shared_ptr<SessionCore> core;
  uint64_t handle;
  uint32_t rank;
  uint32_t nranks;
  std::string executor = "cpu";  // tandemd's JoinCommunicatorReply.executor (cuda backend)
  std::unique_ptr<tandem::client::CommExecutor> exec;  // this rank's side of the backend; reset by tandem_disconnect
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

// Open sessions by serial, for the ops (plain values) that name them. Never destroyed: a session still open when the
// process exits must not be closed by a static destructor that runs after the libraries it uses are gone.
struct Registry {
  std::shared_mutex mutex;
  std::unordered_map<uint64_t, std::shared_ptr<SessionCore>> open;
  std::atomic<uint64_t> nextSerial{1};
};
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// What a call on a handle of a closed session says, for each kind of handle.
enum class Handle { kSession, kBuffer, kComm, kOp };

[[noreturn]] void failClosed(std::string_view call, Handle h) {
  switch (h) {
    case Handle::kBuffer:
      fail(ErrorCode::kInvalidArgument, "{}: this buffer belongs to a session that tandem_disconnect closed, which "
           "released its memory; free the handle (tandem_free, or tandem_deregister if it was registered) and use a "
           "buffer of an open session", call);
    case Handle::kComm:
      fail(ErrorCode::kInvalidArgument, "{}: this communicator belongs to a session that tandem_disconnect closed, "
           "which ended it; free the handle with tandem_comm_destroy and join again on an open session "
           "(tandem_comm_init)", call);
    case Handle::kOp:
      fail(ErrorCode::kInvalidArgument, "{}: this op belongs to a session that tandem_disconnect closed, so its outcome "
           "is unknown; wait for ops before disconnecting their session", call);
    case Handle::kSession: break;
  }
  fail(ErrorCode::kInvalidArgument, "{}: this session was closed by tandem_disconnect (on another thread); a session "
       "handle is invalid once tandem_disconnect is called on it", call);
}

// A call on `core` (the session or one of its handles): holds `life` shared, so tandem_disconnect waits for it to end.
// Throws the closed-session error if the session is already closed.
class Use {
 public:
  Use(SessionCore& core, std::string_view call, Handle h) : lock_(core.life) {
    if (core.closed) failClosed(call, h);
  }

 private:
  std::shared_lock<std::shared_mutex> lock_;
};

// An accessor (no status to return): runs body() as a call on `core`; on failure records the message for
// tandem_last_error() and leaves the result at its default. Unlike guarded(), success leaves the last error alone.
template <typename F>
void access(SessionCore& core, std::string_view call, Handle h, F&& body) {
  try {
    const Use use(core, call, h);
    body();
  } catch (const Error& e) {
    record(e.code(), e.what());
  }
}

// Runs body() as a call on `core`. A call that tandem_disconnect cut short (on another thread) fails with that reason
// instead of the hang-up it saw.
template <typename F>
void onCore(SessionCore& core, std::string_view call, F&& body) {
  try {
    body();
  } catch (const Error& e) {
    if (core.closing.load()) {
      fail(ErrorCode::kInvalidArgument, "{}: tandem_disconnect closed the session while this call was in flight (on "
           "another thread); finish calls before disconnecting", call);
    }
    throw;
  }
}

void addHandle(SessionCore& core, tandem_buffer* b) {
  std::lock_guard lock(core.handlesMutex);
  core.buffers.insert(b);
}
void addHandle(SessionCore& core, tandem_comm* c) {
  std::lock_guard lock(core.handlesMutex);
  core.comms.insert(c);
}
void dropHandle(SessionCore& core, tandem_buffer* b) {
  std::lock_guard lock(core.handlesMutex);
  core.buffers.erase(b);
}
void dropHandle(SessionCore& core, tandem_comm* c) {
  std::lock_guard lock(core.handlesMutex);
  core.comms.erase(c);
}

// The buffer's memory in this process. Caller holds its core's `life`, open.
void* mappedPtr(const tandem_buffer& b) {
  if (b.registered) return b.userPtr;
  return b.memory ? b.memory->ptr() : nullptr;
}

tandem::BufferRef ref(const SessionCore& core, const tandem_tensor_t& t, const tandem::SlotRule& rule) {
  if (t.buffer == nullptr) return {0, 0, rule.bytes};
  if (t.buffer->core.get() != &core) {
    fail(ErrorCode::kInvalidArgument, "tensor {} lives in a buffer of another session; use buffers of the session "
         "the communicator belongs to", rule.name);
  }
  return {t.buffer->id, t.offset, rule.bytes};
}

// Rolls back a half-finished call (the daemon already created something the client could not set up). The
// original error is what the caller needs to see, so a failure of the rollback itself is dropped.
void undoQuietly(SessionCore& core, tandem::v1::Request& undo) {
  try {
    core.impl->call(undo);
  } catch (...) {
  }
}

constexpr std::size_t kMaxReplayProbes = 4096;  // eager ops awaiting a wait, per session (replayProbes)

// An eager op's final result: a replay on its communicator that failed on its own since the last report (an MoE op's
// bad expert id or row overflow; every replay before this op in its stream has finished by now) turns a success into
// that error. Only the caller's view changes: the op ran, and nothing collective depends on when this is seen.
// The result sticks to the op: tandem_wait and tandem_op_status of it say the same every time.
void reportReplayFault(SessionCore& core, uint64_t seq, tandem::client::OpResult& r) {
  if (r.code == ErrorCode::kInProgress || r.code == ErrorCode::kTimeout) return;  // not final yet
  std::lock_guard lock(core.probesMutex);  // the probe takes its communicator's lock only, never this one
  const auto it = core.replayProbes.find(seq);
  if (it == core.replayProbes.end()) return;
  if (r.code != ErrorCode::kOk) {  // its own failure first; the replay's stays for a later op
    core.replayProbes.erase(it);
    return;
  }
  if (!it->second.result) {
    const std::string fault = it->second.probe();
    if (fault.empty()) {
      core.replayProbes.erase(it);
      return;
    }
    it->second.result = tandem::client::OpResult{
        ErrorCode::kInvalidArgument,
        fmt::format("op {} completed, but on its communicator {}. That replay wrote no output; this op ran, and the "
                    "communicator is still usable: correct the graph's inputs before replaying it again", seq, fault)};
  }
  r = *it->second.result;
}

// Fills every slot's BufferRef from the tensors, validates the descriptor as the daemon will, and submits through
// the communicator's executor: on the cuda backend it also checks that this rank's GPU can run the op (before
// submitting: a refused op changes nothing), then enqueues its stream work on `stream` (a cudaStream_t; null = the
// legacy default stream).
tandem_status_t submitOp(const char* call, tandem_comm_t comm, tandem::OpDescriptor desc,
                         std::span<const tandem_tensor_t> tensors, tandem_op_t* op, void* stream = nullptr) {
  return guarded([&] {
    require(comm != nullptr && op != nullptr, "comm and op must not be NULL");
    SessionCore& core = *comm->core;
    const Use use(core, call, Handle::kComm);  // the tensors' buffers are checked to be of this session too
    onCore(core, call, [&] {
      desc.version = tandem::kDescriptorVersion;
      desc.rank = comm->rank;
      desc.nranks = comm->nranks;
      desc.commHandle = comm->handle;
      const tandem::SlotRules rules = tandem::expectedSlots(desc);
      std::size_t i = 0;
      for (const tandem_tensor_t& t : tensors) {
        desc.bufs[i] = ref(core, t, rules[i]);
        if (t.buffer == nullptr && !rules[i].optional && rules[i].bytes > 0) {
          fail(ErrorCode::kInvalidArgument, "{}: tensor {} is required but its buffer is NULL",
               tandem::opKindName(desc.kind), rules[i].name);
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
      tandem::client::TensorPointers ptrs{};
      for (std::size_t s = 0; s < i; ++s) {
        const tandem_tensor_t& t = tensors.begin()[s];
        if (t.buffer != nullptr) ptrs[s] = static_cast<char*>(mappedPtr(*t.buffer)) + t.offset;
      }
      // An op captured into a CUDA graph on a multi-rank communicator is not submitted to tandemd (its stream is its
      // completion): its handle keeps seq 0, which tandem_wait and tandem_test answer with NOT_FOUND.
      op->session_serial = core.serial;
      op->seq = 0;
      comm->exec->submit(
          desc, ptrs, stream,
          [&] {
            op->session_serial = core.serial;
            op->seq = core.impl->submit(desc);
          },
          [&] {
            tandem::v1::Request abort;
            abort.mutable_destroy_comm()->set_comm_handle(comm->handle);
            abort.mutable_destroy_comm()->set_abort(true);
            undoQuietly(core, abort);
          });
      if (op->seq != 0) {
        if (auto probe = comm->exec->replayFaultProbe()) {
          std::lock_guard lock(core.probesMutex);
          core.replayProbes[op->seq] = {std::move(probe), std::nullopt};
          if (core.replayProbes.size() > kMaxReplayProbes) core.replayProbes.erase(core.replayProbes.begin());
        }
      }
    });
  });
}

tandem_status_t submitOp(const char* call, tandem_comm_t comm, const tandem::OpDescriptor& desc,
                         std::initializer_list<tandem_tensor_t> tensors, tandem_op_t* op, void* stream = nullptr) {
  return submitOp(call, comm, desc, std::span<const tandem_tensor_t>(tensors.begin(), tensors.size()), op, stream);
}

tandem::OpDescriptor descriptor(tandem::OpKind kind, tandem_dtype_t dtype) {
  tandem::OpDescriptor desc{};
  desc.kind = kind;
  desc.dtype = static_cast<tandem::DType>(dtype);
  return desc;
}

// A tandem_<op> entry point: reads its argument struct through the op table (c_args.hpp) and submits it. The struct
// is checked before comm and op, so a bad struct is reported first whatever else is wrong.
tandem_status_t submitArgs(tandem::OpKind kind, tandem_comm_t comm, const void* args, tandem_op_t* op) {
  const tandem::OpSpec& spec = tandem::opSpec(kind);
  tandem::client::CArgs a;
  const tandem_status_t s = guarded([&] { a = tandem::client::unpackArgs(spec, args); });
  if (s != TANDEM_SUCCESS) return s;
  const std::string call(spec.cArgsFunction);
  return submitOp(call.c_str(), comm, a.desc, std::span<const tandem_tensor_t>(a.tensors.data(), a.tensorCount), op,
                  a.stream);
}

// The open session an op names, or the error that says why there is none.
std::shared_ptr<SessionCore> coreOf(const tandem_op_t& op, std::string_view call) {
  if (op.session_serial == 0) fail(ErrorCode::kInvalidArgument, "{}: op has no session (was it submitted?)", call);
  Registry& r = registry();
  {
    std::shared_lock lock(r.mutex);
    if (auto it = r.open.find(op.session_serial); it != r.open.end()) return it->second;
  }
  if (op.session_serial < r.nextSerial.load()) failClosed(call, Handle::kOp);
  fail(ErrorCode::kInvalidArgument, "{}: op names session {}, which this process never opened (is the tandem_op_t "
       "uninitialised or from another process?)", call, op.session_serial);
}

// Releases a buffer's mapping in this process; the daemon's memory is freed by the caller's request or by the end
// of the session.
void unmap(tandem_buffer& b) { b.memory.reset(); }

// Frees a buffer handle: asks the daemon to release it (free or deregister), and unmaps it. The handle is freed
// whatever happens, as tandem.h promises.
tandem_status_t releaseBuffer(tandem_buffer_t buffer, bool registered, const char* call) {
  if (buffer == nullptr) return record(ErrorCode::kInvalidArgument, std::string(call) + ": buffer must not be NULL");
  const std::unique_ptr<tandem_buffer> owned(buffer);  // destroyed last, after the lock below is released
  SessionCore& core = *buffer->core;
  return guarded([&] {
    const Use use(core, call, Handle::kBuffer);  // closed: tandem_disconnect already unmapped it
    dropHandle(core, buffer);
    unmap(*buffer);
    onCore(core, call, [&] {
      tandem::v1::Request request;
      if (registered) {
        request.mutable_deregister()->set_buffer_id(buffer->id);
      } else {
        request.mutable_free()->set_buffer_id(buffer->id);
      }
      core.impl->call(request);
    });
  });
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

const char* tandem_op_table(void) {
  static const std::string json = tandem::opTableJson();
  return json.c_str();
}

int tandem_get_version(int* major, int* minor, int* patch) {
  if (major != nullptr) *major = TANDEM_VERSION_MAJOR;
  if (minor != nullptr) *minor = TANDEM_VERSION_MINOR;
  if (patch != nullptr) *patch = TANDEM_VERSION_PATCH;
  return TANDEM_VERSION_CODE;
}

size_t tandem_dtype_size(tandem_dtype_t dtype) { return tandem::dtypeSize(static_cast<tandem::DType>(dtype)); }

tandem_status_t tandem_connect(const char* socket_path, tandem_session_t* out) {
  return guarded([&] {
    require(out != nullptr, "out must not be NULL");
    const std::string path = socket_path != nullptr ? socket_path : tandem::clientSocketPath();
    auto core = std::make_shared<SessionCore>();
    core->impl = tandem::client::Session::connect(path);
    core->backend = tandem::client::makeClientBackend(*core->impl);
    auto session = std::make_unique<tandem_session>();
    session->core = core;
    Registry& r = registry();
    {
      std::unique_lock lock(r.mutex);
      core->serial = r.nextSerial.fetch_add(1);
      r.open.emplace(core->serial, core);
    }
    *out = session.release();
  });
}

tandem_status_t tandem_disconnect(tandem_session_t session) {
  if (session == nullptr) return record(ErrorCode::kInvalidArgument, "tandem_disconnect: session must not be NULL");
  std::unique_ptr<tandem_session> owned(session);
  const std::shared_ptr<SessionCore> core = session->core;
  return guarded([&] {
    {
      Registry& r = registry();
      std::unique_lock lock(r.mutex);
      r.open.erase(core->serial);  // its ops now fail as ops of a closed session
    }
    // Hang up first: a call blocked on another thread (a wait, a rendezvous, a full ring) returns at once instead of
    // keeping `life` shared until its deadline. tandemd sees the session end and frees what it held for it.
    core->closing = true;
    core->impl->hangUp();
    std::unique_lock life(core->life);
    core->closed = true;
    core->backend->close();  // stops watching the socket before it is closed below
    {
      std::lock_guard lock(core->handlesMutex);
      for (tandem_comm* c : core->comms) c->exec.reset();  // cuda: unregisters and unmaps the control page, workspaces
      for (tandem_buffer* b : core->buffers) unmap(*b);
      core->comms.clear();
      core->buffers.clear();
    }
    {
      std::lock_guard lock(core->registrationMutex);
      core->registrations.clear();
    }
    core->impl.reset();  // closes the socket and unmaps the rings
  });
}

const char* tandem_session_backend(tandem_session_t session) {
  return session != nullptr ? session->core->impl->backend().c_str() : "";
}

tandem_status_t tandem_alloc(tandem_session_t session, uint64_t bytes, tandem_buffer_t* out) {
  return guarded([&] {
    require(session != nullptr && out != nullptr, "session and out must not be NULL");
    SessionCore& core = *session->core;
    const Use use(core, "tandem_alloc", Handle::kSession);
    onCore(core, "tandem_alloc", [&] {
      tandem::v1::Request request;
      request.mutable_allocate()->set_bytes(bytes);
      const int device = core.backend->prepareAllocate(*request.mutable_allocate());
      std::vector<tandem::Fd> fds;
      const auto response = core.impl->call(request, {}, &fds, 1);
      auto buffer = std::make_unique<tandem_buffer>();
      buffer->core = session->core;
      buffer->id = response.allocate().buffer_id();
      buffer->bytes = response.allocate().bytes();
      buffer->registered = false;
      buffer->userPtr = nullptr;
      try {
        buffer->memory = core.backend->mapAllocation(fds[0], response.allocate(), device);
        addHandle(core, buffer.get());
      } catch (...) {
        tandem::v1::Request undo;
        undo.mutable_free()->set_buffer_id(buffer->id);
        undoQuietly(core, undo);
        throw;
      }
      *out = buffer.release();
    });
  });
}

tandem_status_t tandem_free(tandem_buffer_t buffer) {
  if (buffer != nullptr && buffer->registered) {
    return record(ErrorCode::kInvalidArgument, "tandem_free: this buffer was registered; release it with "
                  "tandem_deregister");
  }
  return releaseBuffer(buffer, false, "tandem_free");
}

tandem_status_t tandem_deregister(tandem_buffer_t buffer) {
  if (buffer != nullptr && !buffer->registered) {
    return record(ErrorCode::kInvalidArgument, "tandem_deregister: this buffer was allocated; release it with "
                  "tandem_free");
  }
  if (buffer != nullptr && buffer->core->backend->sharesRegistrations()) {
    SessionCore& core = *buffer->core;
    const std::shared_lock life(core.life);
    std::lock_guard lock(core.registrationMutex);
    // Another registration of the same range still holds it. Once the session is closed the map is empty, and each
    // deregistration frees its share: the last one frees the handle.
    if (--buffer->refs > 0) {
      return core.closed ? record(ErrorCode::kInvalidArgument, "tandem_deregister: this buffer belongs to a session "
                                  "that tandem_disconnect closed; this registration is released, the others of the "
                                  "same range still need their tandem_deregister")
                         : TANDEM_SUCCESS;
    }
    std::erase_if(core.registrations, [&](const auto& kv) { return kv.second == buffer; });
  }
  return releaseBuffer(buffer, true, "tandem_deregister");
}

void* tandem_buffer_ptr(tandem_buffer_t buffer) {
  void* ptr = nullptr;
  if (buffer != nullptr) access(*buffer->core, "tandem_buffer_ptr", Handle::kBuffer, [&] { ptr = mappedPtr(*buffer); });
  return ptr;
}

uint64_t tandem_buffer_size(tandem_buffer_t buffer) {
  uint64_t bytes = 0;
  if (buffer != nullptr) access(*buffer->core, "tandem_buffer_size", Handle::kBuffer, [&] { bytes = buffer->bytes; });
  return bytes;
}

tandem_status_t tandem_register(tandem_session_t session, void* ptr, uint64_t bytes, int fd, uint64_t fd_offset,
                                tandem_buffer_t* out) {
  return guarded([&] {
    require(session != nullptr && out != nullptr && ptr != nullptr, "session, ptr and out must not be NULL");
    SessionCore& core = *session->core;
    const Use use(core, "tandem_register", Handle::kSession);
    onCore(core, "tandem_register", [&] {
      const bool shared = core.backend->sharesRegistrations();
      std::unique_lock<std::mutex> lock(core.registrationMutex, std::defer_lock);
      const auto key = std::make_pair(reinterpret_cast<uintptr_t>(ptr), bytes);
      if (shared) {
        lock.lock();
        if (auto it = core.registrations.find(key); it != core.registrations.end()) {
          ++it->second->refs;  // the same range again: the same buffer (and id)
          *out = it->second;
          return;
        }
      }
      tandem::v1::Request request;
      core.backend->describeRegistration(*request.mutable_register_buffer(), ptr, bytes, fd, fd_offset);
      const int fds[] = {fd};
      const auto response = core.impl->call(request, fd >= 0 ? std::span<const int>(fds) : std::span<const int>());
      auto buffer = std::make_unique<tandem_buffer>();
      buffer->core = session->core;
      buffer->id = response.register_buffer().buffer_id();
      buffer->bytes = bytes;
      buffer->registered = true;
      buffer->userPtr = ptr;
      if (shared) core.registrations[key] = buffer.get();
      addHandle(core, buffer.get());
      *out = buffer.release();
    });
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
  return tandem_comm_init_config(session, id, nranks, rank, timeout_ms, nullptr, out);
}

tandem_status_t tandem_comm_init_config(tandem_session_t session, const tandem_unique_id_t* id, uint32_t nranks,
                                        uint32_t rank, uint32_t timeout_ms, const tandem_comm_config_t* config,
                                        tandem_comm_t* out) {
  return guarded([&] {
    require(session != nullptr && id != nullptr && out != nullptr, "session, id and out must not be NULL");
    require(config == nullptr || config->struct_size >= sizeof(tandem_comm_config_t),
            "config->struct_size is not sizeof(tandem_comm_config_t)");
    SessionCore& core = *session->core;
    const Use use(core, "tandem_comm_init", Handle::kSession);
    onCore(core, "tandem_comm_init", [&] {
      tandem::v1::Request request;
      auto* join = request.mutable_join_comm();
      join->set_unique_id(std::string(reinterpret_cast<const char*>(id->bytes), sizeof id->bytes));
      join->set_nranks(nranks);
      join->set_rank(rank);
      join->set_timeout_ms(timeout_ms);
      if (config != nullptr) join->set_workspace_bytes(config->workspace_bytes);
      const int device = core.backend->prepareJoin(*join);
      // The daemon enforces the rendezvous timeout; our own only guards against a daemon that stops answering.
      const int64_t waitMs = (timeout_ms == 0 ? 300000 : int64_t{timeout_ms}) + 5000;
      std::vector<tandem::Fd> fds;
      const auto response = core.impl->call(request, {}, &fds, core.backend->joinFds(), waitMs);
      auto comm = std::make_unique<tandem_comm>();
      comm->core = session->core;
      comm->handle = response.join_comm().comm_handle();
      comm->rank = rank;
      comm->nranks = nranks;
      try {
        comm->exec = core.backend->attach(*core.impl, comm->handle, rank, nranks, response.join_comm(), fds, device);
        comm->executor = core.backend->executorName(response.join_comm());
      } catch (...) {
        tandem::v1::Request undo;
        undo.mutable_destroy_comm()->set_comm_handle(comm->handle);
        undoQuietly(core, undo);
        throw;
      }
      addHandle(core, comm.get());
      *out = comm.release();
    });
  });
}

tandem_status_t tandem_comm_abort(tandem_comm_t comm) {
  return guarded([&] {
    require(comm != nullptr, "comm must not be NULL");
    SessionCore& core = *comm->core;
    const Use use(core, "tandem_comm_abort", Handle::kComm);
    onCore(core, "tandem_comm_abort", [&] {
      tandem::v1::Request request;
      request.mutable_destroy_comm()->set_comm_handle(comm->handle);
      request.mutable_destroy_comm()->set_abort(true);
      core.impl->call(request);
    });
  });
}

tandem_status_t tandem_comm_destroy(tandem_comm_t comm) {
  if (comm == nullptr) return record(ErrorCode::kInvalidArgument, "tandem_comm_destroy: comm must not be NULL");
  const std::unique_ptr<tandem_comm> owned(comm);  // destroyed last (with its GPU state), after the lock is released
  SessionCore& core = *comm->core;
  const tandem_status_t status = guarded([&] {
    const Use use(core, "tandem_comm_destroy", Handle::kComm);  // closed: tandem_disconnect already released it
    dropHandle(core, comm);
    onCore(core, "tandem_comm_destroy", [&] {
      tandem::v1::Request request;
      request.mutable_destroy_comm()->set_comm_handle(comm->handle);
      request.mutable_destroy_comm()->set_abort(false);
      core.impl->call(request);
    });
  });
  // After an abort or a lost peer the daemon may already have dropped us; the handle is freed regardless.
  return status == TANDEM_ERROR_NOT_FOUND ? TANDEM_SUCCESS : status;
}

uint32_t tandem_comm_rank(tandem_comm_t comm) {
  uint32_t rank = 0;
  if (comm != nullptr) access(*comm->core, "tandem_comm_rank", Handle::kComm, [&] { rank = comm->rank; });
  return rank;
}

uint32_t tandem_comm_nranks(tandem_comm_t comm) {
  uint32_t nranks = 0;
  if (comm != nullptr) access(*comm->core, "tandem_comm_nranks", Handle::kComm, [&] { nranks = comm->nranks; });
  return nranks;
}

tandem_status_t tandem_wait(tandem_op_t op, int64_t timeout_ms) {
  tandem::client::OpResult r;
  const tandem_status_t s = guarded([&] {
    const std::shared_ptr<SessionCore> core = coreOf(op, "tandem_wait");
    // The registry entry goes before the session closes; a wait that found it and starts after the close fails here.
    const Use use(*core, "tandem_wait", Handle::kOp);
    onCore(*core, "tandem_wait", [&] {
      r = core->impl->wait(op.seq, timeout_ms);
      reportReplayFault(*core, op.seq, r);
      // Cut short by tandem_disconnect: the hang-up, or the failure tandemd posted as it ended the session.
      if (r.code != ErrorCode::kOk && core->closing.load()) throw Error(r.code, r.message);
    });
  });
  if (s != TANDEM_SUCCESS) return s;
  return r.code == ErrorCode::kOk ? TANDEM_SUCCESS : record(r.code, r.message);
}

tandem_status_t tandem_op_status(tandem_op_t op, char* message, size_t message_len) {
  tandem::client::OpResult r;
  const tandem_status_t s = guarded([&] {
    const std::shared_ptr<SessionCore> core = coreOf(op, "tandem_op_status");
    const Use use(*core, "tandem_op_status", Handle::kOp);
    onCore(*core, "tandem_op_status", [&] {
      r = core->impl->status(op.seq);
      reportReplayFault(*core, op.seq, r);
      if (r.code != ErrorCode::kOk && r.code != ErrorCode::kInProgress && core->closing.load()) {
        throw Error(r.code, r.message);
      }
    });
  });
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

tandem_status_t tandem_ag_gemm(tandem_comm_t comm, const tandem_ag_gemm_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kAgGemm, comm, args, op);
}

tandem_status_t tandem_gemm_rs(tandem_comm_t comm, const tandem_gemm_rs_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kGemmRs, comm, args, op);
}

tandem_status_t tandem_gemm_ar(tandem_comm_t comm, const tandem_gemm_ar_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kGemmAr, comm, args, op);
}

tandem_status_t tandem_moe_dispatch_gemm(tandem_comm_t comm, const tandem_moe_dispatch_gemm_args_t* args,
                                         tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kMoeDispatchGemm, comm, args, op);
}

tandem_status_t tandem_moe_dispatch_ffn_combine(tandem_comm_t comm, const tandem_moe_ffn_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kMoeDispatchFfnCombine, comm, args, op);
}

tandem_status_t tandem_ring_attention(tandem_comm_t comm, const tandem_ring_attention_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kRingAttention, comm, args, op);
}

tandem_status_t tandem_moe_dispatch_ffn_combine_backward(tandem_comm_t comm, const tandem_moe_ffn_backward_args_t* args,
                                                         tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kMoeFfnBackward, comm, args, op);
}

tandem_status_t tandem_ring_attention_backward(tandem_comm_t comm, const tandem_ring_attention_backward_args_t* args,
                                               tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kRingAttentionBackward, comm, args, op);
}

tandem_status_t tandem_allgather(tandem_comm_t comm, const tandem_allgather_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kAllGather, comm, args, op);
}

tandem_status_t tandem_barrier_stream(tandem_comm_t comm, const tandem_barrier_args_t* args, tandem_op_t* op) {
  return submitArgs(tandem::OpKind::kNop, comm, args, op);
}

tandem_status_t tandem_barrier(tandem_comm_t comm, tandem_op_t* op) {
  return submitOp("tandem_barrier", comm, descriptor(tandem::OpKind::kNop, TANDEM_DTYPE_INVALID), {}, op, nullptr);
}

}  // extern "C"

namespace tandem::client {

tandem_status_t submitDescriptor(tandem_comm_t comm, const tandem::OpDescriptor& desc,
                                 std::span<const tandem_tensor_t> tensors, tandem_op_t* op, void* stream) {
  if (tandem::knownOp(desc.kind) && tensors.size() > tandem::opSpec(desc.kind).slotCount) {
    return record(ErrorCode::kInvalidArgument,
                  fmt::format("{}: {} tensors passed but the op has {} slots; pass one tensor per slot of the op table",
                              tandem::opKindName(desc.kind), tensors.size(), tandem::opSpec(desc.kind).slotCount));
  }
  const std::string call = tandem::knownOp(desc.kind) ? std::string(tandem::opSpec(desc.kind).cFunction) : "submit";
  return submitOp(call.c_str(), comm, desc, tensors, op, stream);
}

}  // namespace tandem::client

// tandemctl tune and advise (plan_hook.hpp).
namespace tandem::client {

uint64_t commHandle(tandem_comm_t comm) { return comm->handle; }

const char* commExecutor(tandem_comm_t comm) { return comm->executor.c_str(); }

void setCommPlan(tandem_comm_t comm, const PlanKey& key, const PlanChoice& plan) {
  if (comm->exec) comm->exec->setPlan(key, plan);
}

}  // namespace tandem::client
