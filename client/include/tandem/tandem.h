/* tandem: fused compute + communication ops served by the per-node daemon tandemd.
 *
 * C ABI, stable within a minor version while the version is 0.x (CHANGELOG.md lists every change). Every
 * function that can fail returns a tandem_status_t; TANDEM_SUCCESS is 0. Argument structs begin with
 * `struct_size` (set it to sizeof(the struct)) so fields can be appended without breaking old callers.
 * tandem_last_error() returns the message of the calling thread's most recent failure: it says what
 * failed, why, and what to do.
 *
 * Threading: a session, its buffers and its communicators may be used from several threads; calls are
 * serialised inside. Ops on one communicator must be submitted in the same order on every rank (as with NCCL).
 *
 * Lifetimes: a buffer or communicator handle belongs to the session that made it. tandem_disconnect closes
 * the session and releases everything it still holds (see there); the session handle is then invalid, but
 * its buffer and communicator handles stay valid objects: every later call on them, and tandem_wait and
 * tandem_op_status on the session's ops, fails with TANDEM_ERROR_INVALID_ARGUMENT and a message saying the
 * session was closed (the accessors tandem_buffer_ptr, tandem_buffer_size, tandem_comm_rank and
 * tandem_comm_nranks return NULL or 0 and set that message). tandem_free, tandem_deregister and
 * tandem_comm_destroy still free the handle itself, so call them once per handle, before or after.
 *
 * Shapes: "rows_of(M, r, n)" is the balanced row split every sharded op uses: rank r owns
 * M/n + (r < M%n ? 1 : 0) rows, starting at row r*(M/n) + min(r, M%n). All matrices are row-major and
 * contiguous. GEMMs follow nn.Linear: C = A · Bᵀ with A [M, K] and B [N, K] (both K-major). Accumulation
 * is fp32 for every dtype; outputs are rounded once to the output dtype.
 *
 * CUDA graphs (cuda backend): an op enqueued on a stream that is being captured is recorded into the graph.
 * On a one-rank communicator every op may be captured. On a communicator of several ranks, with tandemd's
 * executor client, tandem_allgather, tandem_ag_gemm, tandem_gemm_rs, tandem_gemm_ar, tandem_ring_attention,
 * tandem_moe_dispatch_gemm, tandem_moe_dispatch_ffn_combine and tandem_barrier_stream may be captured
 * (replayed ops take their epoch from device memory: ARCHITECTURE.md, "CUDA graphs"); the backward ops
 * (not on GPUs yet), and every op under executor daemon or across nodes, fail with
 * TANDEM_ERROR_UNSUPPORTED and the reason, and nothing is recorded. The contract:
 *   - A captured op is not submitted to tandemd: its tandem_op_t has seq 0 (tandem_wait and tandem_op_status
 *     answer TANDEM_ERROR_NOT_FOUND), and its completion is the stream's. Its buffers are tandem buffers,
 *     allocated or registered before the capture (registration talks to tandemd, which a capture cannot hold).
 *   - Every rank captures, replays and enqueues the same ops in the same order (eager ops and replays of any
 *     number of graphs may interleave). A rank that replays another op than its peers at the same place fails
 *     the communicator (its error names the divergence) instead of exchanging wrong data; a rank that stops
 *     midway leaves its peers' replays to their deadline (TANDEM_OP_TIMEOUT_MS), or, when it dies, to
 *     tandemd's PEER_LOST. A failure inside a replay shows in the communicator's next eager op. A replayed
 *     MoE op whose expert ids are bad or whose rows overflow a rank writes nothing and fails alone: the next
 *     tandem_wait or tandem_op_status of an eager op of that communicator that would succeed returns
 *     TANDEM_ERROR_INVALID_ARGUMENT naming the op, the rank and the id or rows instead (that op ran), and the
 *     communicator stays usable. Once a
 *     communicator captured an op, an eager collective whose ranks disagree (shapes, dtype) fails the
 *     communicator too, not only the op.
 *   - Each replayed op starts with a barrier over the ranks (a few microseconds); eager ops on a communicator
 *     that captured ops start with it too. Destroy such a communicator only once every rank's stream finished
 *     (e.g. after a tandem_barrier): a rank that leaves aborts its peers' replays.
 */
#ifndef TANDEM_TANDEM_H_
#define TANDEM_TANDEM_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TANDEM_API __attribute__((visibility("default")))

/* Bumped when the wire protocol changes incompatibly. */
#define TANDEM_PROTOCOL_VERSION 3u

/* The version of this header, equal to the CMake project version the library was built from (the build
 * checks it). TANDEM_VERSION_CODE orders versions as one number: major * 10000 + minor * 100 + patch (minor
 * and patch stay below 100). Compare it with tandem_get_version() to find the library a program runs with. */
#define TANDEM_VERSION_MAJOR 0
#define TANDEM_VERSION_MINOR 2
#define TANDEM_VERSION_PATCH 0
#define TANDEM_MAKE_VERSION_CODE(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))
#define TANDEM_VERSION_CODE TANDEM_MAKE_VERSION_CODE(TANDEM_VERSION_MAJOR, TANDEM_VERSION_MINOR, TANDEM_VERSION_PATCH)

typedef enum tandem_status {
  TANDEM_SUCCESS = 0,
  TANDEM_ERROR_INVALID_ARGUMENT = 1, /* a bad argument or descriptor; nothing was written */
  TANDEM_ERROR_PROTOCOL = 2,         /* malformed frame or message */
  TANDEM_ERROR_VERSION_MISMATCH = 3, /* client and daemon speak different protocol versions */
  TANDEM_ERROR_PERMISSION_DENIED = 4,/* uid/gid not allowed by the daemon's config */
  TANDEM_ERROR_NOT_FOUND = 5,        /* unknown buffer, communicator or op */
  TANDEM_ERROR_OUT_OF_MEMORY = 6,
  TANDEM_ERROR_TIMEOUT = 7,          /* a wait or rendezvous ran past its deadline; the op may still finish */
  TANDEM_ERROR_PEER_LOST = 8,        /* another rank of the communicator died or aborted */
  TANDEM_ERROR_DAEMON_LOST = 9,      /* the connection to tandemd is gone; the session is dead */
  TANDEM_ERROR_ABORTED = 10,         /* the communicator was aborted */
  TANDEM_ERROR_UNSUPPORTED = 11,     /* the backend does not implement this op or dtype */
  TANDEM_ERROR_UNAVAILABLE = 12,     /* the daemon is not running or not reachable */
  TANDEM_ERROR_INTERNAL = 13,
  TANDEM_ERROR_RING_FULL = 14,       /* the submission ring stayed full past the timeout; nothing was lost */
  TANDEM_IN_PROGRESS = 15            /* tandem_op_status: the op has not completed yet */
} tandem_status_t;

typedef enum tandem_dtype {
  TANDEM_DTYPE_INVALID = 0,
  TANDEM_DTYPE_FP32 = 1,
  TANDEM_DTYPE_FP16 = 2,
  TANDEM_DTYPE_BF16 = 3,
  TANDEM_DTYPE_INT32 = 4, /* index tensors only (MoE top-k expert ids) */
  /* OCP FP8, one byte: a and b of ag-gemm, gemm-rs and gemm-ar, with fp32 scales (tandem_fp8_scaling_t) and a
   * bf16 or fp32 c (out_dtype); e4m3 only: w1 and w2 of tandem_moe_dispatch_ffn_combine (w_dtype, with block
   * scales). e4m3: max 448, for weights and activations; e5m2: max 57344, for gradients. */
  TANDEM_DTYPE_FP8_E4M3 = 5,
  TANDEM_DTYPE_FP8_E5M2 = 6
} tandem_dtype_t;

typedef struct tandem_session* tandem_session_t; /* one connection to tandemd */
typedef struct tandem_buffer* tandem_buffer_t;   /* memory the daemon knows; owned by one session */
typedef struct tandem_comm* tandem_comm_t;       /* one rank's membership of a communicator */

/* An in-flight op. Plain value: copy it freely. After its session is closed, tandem_wait and
 * tandem_op_status on it fail with TANDEM_ERROR_INVALID_ARGUMENT. */
typedef struct tandem_op {
  uint64_t session_serial; /* the submitting session, numbered in this process and never reused; 0: no op */
  uint64_t seq;            /* the op's number within its session */
} tandem_op_t;

/* 128 unguessable bits (getrandom). Every rank passes the same id to tandem_comm_init. */
typedef struct tandem_unique_id {
  uint8_t bytes[16];
} tandem_unique_id_t;

/* A tensor: memory in a tandem buffer at a byte offset. Its extent follows from the op's shape and dtype. */
typedef struct tandem_tensor {
  tandem_buffer_t buffer; /* NULL means "absent" where a tensor is optional */
  uint64_t offset;        /* bytes; must be a multiple of the element size */
} tandem_tensor_t;

TANDEM_API const char* tandem_strerror(tandem_status_t status);
/* Message of this thread's last failed call ("" if none). Valid until this thread's next tandem call. */
TANDEM_API const char* tandem_last_error(void);
/* The library's version as text ("0.2.0"). */
TANDEM_API const char* tandem_version(void);
/* The library's version: returns its TANDEM_VERSION_CODE and stores its parts where the pointers are not
 * NULL. A program built against this header can check TANDEM_VERSION_CODE == tandem_get_version(0, 0, 0)
 * (or, within 0.x, equal major and minor) before calling anything else. */
TANDEM_API int tandem_get_version(int* major, int* minor, int* patch);
/* Every op this library runs, as one JSON document: each op's name, dims, tensor slots (element type, extent as a
 * product of terms, which are outputs), the fields of its argument struct with their offsets and the struct's size,
 * and its C function. Bindings build themselves from it (the Python package does). A static string, valid for the
 * library's lifetime; thread-safe. */
TANDEM_API const char* tandem_op_table(void);
TANDEM_API size_t tandem_dtype_size(tandem_dtype_t dtype);

/* ---- sessions ---------------------------------------------------------------------------------------
 * socket_path NULL: $TANDEM_SOCKET, else /run/tandem/tandemd.sock as root, else
 * $XDG_RUNTIME_DIR/tandem/tandemd.sock when it exists, else the system daemon's /run/tandem/tandemd.sock.
 * TANDEM_ERROR_UNAVAILABLE when no daemon answers, or when this user may not open the socket (the message
 * names the group to join). */
TANDEM_API tandem_status_t tandem_connect(const char* socket_path, tandem_session_t* out);
/* Closes the session and releases what it still holds: unmaps every buffer (cuda: releases its device
 * mapping), releases every communicator's GPU state (control page, workspaces) and closes the connection, so
 * tandemd frees the memory and ends the communicators (other ranks' later ops fail with PEER_LOST). It does
 * the same when the process dies. Disconnect only after the streams that use the session's buffers and
 * communicators are done, as for tandem_free and tandem_comm_destroy.
 * Calls that other threads are making on the session or its handles finish first; those blocked in
 * tandem_wait, tandem_comm_init or on a full ring return at once with TANDEM_ERROR_INVALID_ARGUMENT.
 * Afterwards `session` is invalid (like a pointer after free(): do not pass it again, not even to
 * tandem_disconnect); its buffer and communicator handles fail every call and still need their
 * tandem_free, tandem_deregister or tandem_comm_destroy to free the handle (see "Lifetimes" above). */
TANDEM_API tandem_status_t tandem_disconnect(tandem_session_t session);
/* Backend the daemon runs ("cpu" or "cuda"); valid for the session's lifetime. */
TANDEM_API const char* tandem_session_backend(tandem_session_t session);

/* ---- memory --------------------------------------------------------------------------------------
 * cuda backend (tandem_session_backend() == "cuda"): buffers are GPU memory. tandem_alloc allocates on the
 * calling thread's current device (cuMem, exported by tandemd as a POSIX fd) and maps it here with access for
 * that device: tandem_buffer_ptr returns a DEVICE pointer (use it in kernels and cudaMemcpy, never
 * dereference it on the host). Free a buffer only after the streams that use it are done. */
/* Allocates `bytes` of daemon-owned shared memory, mapped into this process (tandem_buffer_ptr). */
TANDEM_API tandem_status_t tandem_alloc(tandem_session_t session, uint64_t bytes, tandem_buffer_t* out);
/* Releases an allocated buffer and frees its handle (also when it fails: the handle is gone either way). */
TANDEM_API tandem_status_t tandem_free(tandem_buffer_t buffer);
/* The buffer's mapping in this process, and its size in bytes (NULL and 0 once its session is closed). */
TANDEM_API void* tandem_buffer_ptr(tandem_buffer_t buffer);
TANDEM_API uint64_t tandem_buffer_size(tandem_buffer_t buffer);
/* Registers memory this process already has. CPU backend: `ptr` must lie in a MAP_SHARED mapping of a
 * memfd (memfd_create) that this process still holds open as `fd`, at byte `fd_offset` of that file.
 * The daemon maps the same file; the caller keeps ownership of its memory.
 * cuda backend: `ptr` is GPU memory. fd -1: cudaMalloc memory (tandemd opens its legacy CUDA IPC handle).
 * fd >= 0: memory from cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; fd is its exported handle
 * and fd_offset the offset of ptr in that allocation. Registering the same (ptr, bytes) again returns the
 * same buffer; each registration needs its own tandem_deregister, and the last one releases it. */
TANDEM_API tandem_status_t tandem_register(tandem_session_t session, void* ptr, uint64_t bytes, int fd,
                                           uint64_t fd_offset, tandem_buffer_t* out);
/* Releases one registration; the last one frees the handle (also when it fails). */
TANDEM_API tandem_status_t tandem_deregister(tandem_buffer_t buffer);

/* ---- communicators -------------------------------------------------------------------------------- */
TANDEM_API tandem_status_t tandem_get_unique_id(tandem_unique_id_t* out);
/* Blocks until all `nranks` ranks (1..64) have joined with the same id, or timeout_ms passes
 * (TANDEM_ERROR_TIMEOUT; 0 means the daemon's default). */
TANDEM_API tandem_status_t tandem_comm_init(tandem_session_t session, const tandem_unique_id_t* id,
                                            uint32_t nranks, uint32_t rank, uint32_t timeout_ms,
                                            tandem_comm_t* out);
/* A communicator's options. Zero-initialise, set struct_size = sizeof(tandem_comm_config_t), then fill:
 * workspace_bytes (cuda backend, ranks on one node): GPU memory per rank that this rank's largest ops need in the
 *   communicator's workspace (peers' rows, flags, staging; an op refused for lack of workspace names the bytes it
 *   needs). The communicator gets the largest any rank asks, at least tandemd's cuda.workspace_bytes. It counts
 *   against each rank's limits.max_session_bytes: a join over it fails with TANDEM_ERROR_OUT_OF_MEMORY naming that
 *   key and the bytes. 0: cuda.workspace_bytes. */
typedef struct tandem_comm_config {
  size_t struct_size;
  uint64_t workspace_bytes;
} tandem_comm_config_t;
/* tandem_comm_init with options; config NULL is tandem_comm_init. */
TANDEM_API tandem_status_t tandem_comm_init_config(tandem_session_t session, const tandem_unique_id_t* id,
                                                   uint32_t nranks, uint32_t rank, uint32_t timeout_ms,
                                                   const tandem_comm_config_t* config, tandem_comm_t* out);
/* Aborts the communicator: every rank's pending and future ops fail with TANDEM_ERROR_ABORTED. */
TANDEM_API tandem_status_t tandem_comm_abort(tandem_comm_t comm);
/* Leaves the communicator and frees the handle (also when it fails). Other ranks' later ops fail with
 * PEER_LOST. */
TANDEM_API tandem_status_t tandem_comm_destroy(tandem_comm_t comm);
/* This rank and the number of ranks (0 once the session is closed). */
TANDEM_API uint32_t tandem_comm_rank(tandem_comm_t comm);
TANDEM_API uint32_t tandem_comm_nranks(tandem_comm_t comm);

/* ---- waiting ------------------------------------------------------------------------------------- */
/* Waits until `op` completes (its status) or timeout_ms passes (TANDEM_ERROR_TIMEOUT; the op stays
 * pending). timeout_ms < 0 waits forever, though the daemon's death still ends the wait with
 * TANDEM_ERROR_DAEMON_LOST. */
TANDEM_API tandem_status_t tandem_wait(tandem_op_t op, int64_t timeout_ms);
/* Non-blocking: TANDEM_IN_PROGRESS, or the final status. If `message` is not NULL the op's error text
 * (empty on success) is copied there, NUL-terminated. */
TANDEM_API tandem_status_t tandem_op_status(tandem_op_t op, char* message, size_t message_len);

/* ---- fused ops -------------------------------------------------------------------------------------
 * Every op is collective over its communicator: each rank calls it with the same shape and dtype (per-rank
 * fields are marked). The call validates locally, writes one descriptor into the session's submission
 * ring and returns; the daemon checks the descriptor again (ownership, bounds, shapes) and runs the op
 * once every rank has submitted. Outputs are written only by a successful op. */

/* How the GEMM ops' operands lie in memory (row-major, the last axis contiguous). C = op(A) · op(B) is
 * [m, n] in every layout:
 *   TANDEM_GEMM_NT (0, the default): a [m, k], b [n, k]; C = a · bᵀ. The forward, Y = X · Wᵀ.
 *   TANDEM_GEMM_NN: a [m, k], b [k, n]; C = a · b. The input gradient, dX = dY · W.
 *   TANDEM_GEMM_TN: a [k, m], b [k, n]; C = aᵀ · b. The weight gradient, dW = dYᵀ · X.
 * `layout` was appended to the GEMM ops' structs after 0.2.x (CHANGELOG.md): a caller whose struct_size ends
 * before it gets TANDEM_GEMM_NT. */
typedef enum tandem_gemm_layout {
  TANDEM_GEMM_NT = 0,
  TANDEM_GEMM_NN = 1,
  TANDEM_GEMM_TN = 2,
} tandem_gemm_layout_t;

/* FP8 inputs (dtype TANDEM_DTYPE_FP8_*) of the GEMM ops: how the fp32 a_scale and b_scale apply. They scale the
 * logical operands op(a) [rows, k] and op(b) [n, k], so every layout takes them alike; the product is computed in
 * fp32 from the dequantized values (value * scale) and c is written in out_dtype (TANDEM_DTYPE_BF16 or _FP32).
 *   TANDEM_FP8_SCALE_TENSOR (0): a_scale and b_scale are one fp32 each.
 *   TANDEM_FP8_SCALE_BLOCK (1), blocks of 128 as DeepSeek-V3 (and tandem's FP8 GEMM core): a_scale is
 *     [ceil(k/128), rows] (M-major: k-block kb's scales of all rows are contiguous), op(a)[i][p] scaled by
 *     a_scale[p/128][i]; b_scale is [ceil(n/128), ceil(k/128)], op(b)[j][p] scaled by b_scale[j/128][p/128].
 *     rows: this rank's rows of a (ag-gemm's shard, m for gemm-rs/ar); k: this rank's k (gemm-rs/ar: its slice).
 * Other dtypes take out_dtype 0 (or dtype), scaling 0 and no scales. Both backends run FP8 inputs on one node and
 * across nodes (there in nt on the cuda backend's GPUs, other layouts on its host reference path). The cuda
 * backend runs them on one node on its FP8 GEMM core in
 * TANDEM_GEMM_NT only (fp8 tensor cores read K-major operands: NN and TN are refused, transpose when quantizing), with
 * k (gemm-rs/ar: this rank's slice) a multiple of 16 and, for block scales read in place (gemm-rs/ar, ag-gemm on one
 * rank), m a multiple of 4 and a_scale 16-byte aligned; its fp32 c carries the tensor cores' fp8 accumulation
 * (relative error up to about 2e-3 block-scaled, 1e-2 per tensor). gemm-rs/ar reduce fp32 partials. */
typedef enum tandem_fp8_scaling {
  TANDEM_FP8_SCALE_TENSOR = 0,
  TANDEM_FP8_SCALE_BLOCK = 1,
} tandem_fp8_scaling_t;

/* AllGather + GEMM. A is sharded by rows of op(A): rank r holds rows_of(m, r, n) of them, as [rows, k]
 * (as [k, rows] in TANDEM_GEMM_TN). b is this rank's [n, k] ([k, n] in NN and TN). c = gather(op(A)) · op(b),
 * [m, n] on every rank. a_gathered (optional) receives every rank's shard as stored, in rank order: [m, k]
 * (in TN, n blocks [k, rows_r]). dtype: bf16, fp16 or fp32 for a, b, c and a_gathered; or FP8 for a, b and
 * a_gathered, with c in out_dtype (tandem_fp8_scaling_t). */
typedef struct tandem_ag_gemm_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t m, n, k; /* global m */
  tandem_tensor_t a, b, c, a_gathered;
  void* cuda_stream; /* cuda backend: the caller's cudaStream_t; ignored by the cpu backend */
  /* appended after 0.2.x; struct_size tells whether a caller has it */
  tandem_gemm_layout_t layout;
  /* appended after layout: FP8 inputs (tandem_fp8_scaling_t). out_dtype: c's dtype, 0 = dtype. */
  tandem_dtype_t out_dtype;
  tandem_fp8_scaling_t scaling;
  tandem_tensor_t a_scale, b_scale; /* fp32; FP8 dtypes only */
} tandem_ag_gemm_args_t;
TANDEM_API tandem_status_t tandem_ag_gemm(tandem_comm_t comm, const tandem_ag_gemm_args_t* args, tandem_op_t* op);

/* GEMM + ReduceScatter. K is split across ranks: a is [m, k] and b is [n, k] on this rank (as `layout` says:
 * b [k, n] in NN and TN, a [k, m] in TN), where k is this rank's slice (ranks may differ).
 * C = Σ_r op(a_r) · op(b_r); this rank receives c = C[rows_of(m, r, n)], [rows, n]. */
typedef struct tandem_gemm_rs_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t m, n, k; /* k: this rank's slice */
  tandem_tensor_t a, b, c;
  void* cuda_stream;
  /* appended after 0.2.x; struct_size tells whether a caller has it */
  tandem_gemm_layout_t layout;
  /* appended after layout: FP8 inputs (tandem_fp8_scaling_t). out_dtype: c's dtype, 0 = dtype. */
  tandem_dtype_t out_dtype;
  tandem_fp8_scaling_t scaling;
  tandem_tensor_t a_scale, b_scale; /* fp32; FP8 dtypes only */
} tandem_gemm_rs_args_t;
TANDEM_API tandem_status_t tandem_gemm_rs(tandem_comm_t comm, const tandem_gemm_rs_args_t* args, tandem_op_t* op);

/* GEMM + AllReduce. Inputs as tandem_gemm_rs; every rank receives the full C = Σ_r a_r · b_rᵀ, [m, n]. */
typedef struct tandem_gemm_ar_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t m, n, k; /* k: this rank's slice */
  tandem_tensor_t a, b, c;
  void* cuda_stream;
  /* appended after 0.2.x; struct_size tells whether a caller has it */
  tandem_gemm_layout_t layout;
  /* appended after layout: FP8 inputs (tandem_fp8_scaling_t). out_dtype: c's dtype, 0 = dtype. */
  tandem_dtype_t out_dtype;
  tandem_fp8_scaling_t scaling;
  tandem_tensor_t a_scale, b_scale; /* fp32; FP8 dtypes only */
} tandem_gemm_ar_args_t;
TANDEM_API tandem_status_t tandem_gemm_ar(tandem_comm_t comm, const tandem_gemm_ar_args_t* args, tandem_op_t* op);

/* MoE dispatch + grouped GEMM. This rank has `tokens` rows x [tokens, hidden] (ranks may differ), top-k
 * expert ids topk_ids [tokens, topk] int32 in [0, experts) (no repeats within a row) and weights
 * topk_weights [tokens, topk] fp32. Experts are spread evenly: rank r owns experts
 * [r*E/n, (r+1)*E/n) (experts % nranks must be 0) and holds their weights w [E/n, n_out, hidden].
 * Every (token, slot) is routed to its expert's rank and multiplied there: y = x_t · w_eᵀ, [n_out].
 * Outputs on the expert's rank, in rows grouped by local expert, then source rank, then token, then slot:
 *   out [capacity, n_out] (dtype), row_info [capacity, 4] int32 = {src_rank, src_token, slot, expert},
 *   expert_counts [E/n] int32. capacity is this rank's (ranks may differ); rows past sum(expert_counts) are
 *   left untouched. If more than `capacity` rows arrive, the op fails naming the rows needed. topk_weights
 *   are not used by this op (they travel for a later combine). tokens may be 0 on a rank.
 * cuda backend (ranks on one node): bf16 or fp16; hidden and n_out multiples of 8; topk <= 32; experts <= 1024.
 *   The routing is decided on the GPU (stream-ordered, no host round trip), so a bad expert id or a capacity
 *   overflow is found there: every rank's op fails with the message, nothing is written, and the communicator
 *   fails with it (create a new one).
 * FP8 weights (w_dtype TANDEM_DTYPE_FP8_E4M3; dtype must be bf16: x and out stay bf16): w is e4m3 with fp32 scales
 * per 128 x 128 block of each expert, w_scale [E/n, ceil(n_out/128), ceil(hidden/128)]: w[e][o][p] means
 * w[e][o][p] * w_scale[e][o/128][p/128] (one scale per expert is a block scale repeated over the expert's blocks).
 * x is quantised once on its own rank per 1 x 128 block of each row, exactly as tandem_moe_dispatch_ffn_combine's x
 * (see "FP8 weights" there): x̂ = q * s with q e4m3 and s fp32; the dispatch carries q and s (hidden bytes +
 * hidden/128 fp32 per routed row instead of 2*hidden bytes), and out = x̂ · wᵀ (fp32 accumulation) rounded to bf16.
 *   Accuracy: the cpu backend computes this in fp32 and the fp64 reference in fp64 (both quantise x in fp32 as
 *   above), within 1e-2 relative (Frobenius) of each other; the cuda backend sums as its FP8 grouped GEMM does (the
 *   tensor cores' fp8 sums, promoted to fp32 every 128 k: relative error up to about 2e-3), so it is within 1e-2 of
 *   the reference too, bitwise repeatable. Against the bf16 op on the dequantised weights, the quantisation of x moves
 *   out by a few percent (e4m3 keeps 3 mantissa bits).
 *   w_scale is required with FP8 weights and refused without them; w_dtype e5m2 and a dtype other than bf16 are
 *   refused. cuda backend: hidden a multiple of 16 (the FP8 grouped GEMM's 16-byte rows of e4m3 x), n_out a multiple
 *   of 8 as for bf16; the op's receive rows hold hidden + 4*ceil(hidden/128) + 16 bytes per row of capacity (bf16:
 *   2*hidden + 16). The FP8 grouped GEMM has no swap-AB form, so at decode sizes the op runs the tiled path. */
typedef struct tandem_moe_dispatch_gemm_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t tokens, hidden, n_out, experts, topk, capacity;
  tandem_tensor_t x, topk_ids, topk_weights, w, out, row_info, expert_counts;
  void* cuda_stream;
  /* appended after 0.2.x; struct_size tells whether a caller has them: FP8 weights (see "FP8 weights" above) */
  tandem_dtype_t w_dtype; /* w's dtype: 0 (dtype's) or TANDEM_DTYPE_FP8_E4M3 */
  tandem_tensor_t w_scale; /* fp32 128 x 128 block scales [E/n, ceil(n_out/128), ceil(hidden/128)]; FP8 w_dtype only */
} tandem_moe_dispatch_gemm_args_t;
TANDEM_API tandem_status_t tandem_moe_dispatch_gemm(tandem_comm_t comm, const tandem_moe_dispatch_gemm_args_t* args,
                                                    tandem_op_t* op);

/* MoE dispatch + FFN + combine: the whole layer. Routing as tandem_moe_dispatch_gemm. Each local expert e
 * holds w1 [E/n, 2*ffn, hidden] (rows [0, ffn) are the gate, [ffn, 2*ffn) the up projection) and
 * w2 [E/n, hidden, ffn]. For token x: h = silu(x·w1_gateᵀ) * (x·w1_upᵀ) (rounded to dtype), y = h·w2ᵀ.
 * out [tokens, hidden] on the source rank, in original token order: out_t = Σ_slot weight * y_e(x_t)
 * (y is not rounded to dtype; the cpu backend sums the slots in fp32 in slot order).
 * cuda backend (ranks on one node): as tandem_moe_dispatch_gemm, ffn a multiple of 8; y is rounded to dtype
 * before the weighted sum (fp32, slot order, bitwise repeatable); the experts' rows live in the communicator's
 * workspace (tandem_comm_config_t.workspace_bytes, at least cuda.workspace_bytes), and an op whose rows do not
 * fit fails alone saying how many rows arrived; the communicator stays usable.
 * Saved activations for the backward (training): saved_rows > 0 with a saved tensor [saved_rows, 2*ffn] (dtype) on
 *   this rank makes the op write there, for every row routed to this rank's experts, the row's gate|up before SwiGLU:
 *   saved row i = [a (ffn) | b (ffn)], a = x·w1_gateᵀ and b = x·w1_upᵀ rounded to dtype, rows in the order the op
 *   places them (grouped by local expert, then source rank, then token: the order tandem_moe_dispatch_gemm's out
 *   uses; it follows from every rank's topk_ids alone, so the backward finds the same rows again). 4*ffn bytes per
 *   routed row in bf16/fp16 (8*ffn in fp32); rows past the routed count are left untouched. The routed rows must fit:
 *   an op whose rows exceed saved_rows fails alone naming the rows needed (nothing written; the communicator stays
 *   usable), so pass saved_rows >= this rank's routed rows (at most nranks * tokens * topk; with balanced routing
 *   about tokens * topk). With saved, h = silu(a) * b is computed from the saved (rounded) a and b on both backends,
 *   so the backward's h is the forward's exactly. Pass the same saved tensor and saved_rows to
 *   tandem_moe_dispatch_ffn_combine_backward, and keep it unchanged until then; it is the caller's memory (nothing
 *   is kept in tandemd). saved_rows 0 (or a struct_size that ends before it): nothing is saved. Not with FP8
 *   weights (below), which have no backward.
 * FP8 weights (w_dtype TANDEM_DTYPE_FP8_E4M3; dtype must be bf16: x and out stay bf16): w1 and w2 are e4m3 with fp32
 * scales per 128 x 128 block of each expert (DeepSeek-V3's recipe), w1_scale [E/n, ceil(2*ffn/128), ceil(hidden/128)]
 * and w2_scale [E/n, ceil(hidden/128), ceil(ffn/128)]: w1[e][i][p] means w1[e][i][p] * w1_scale[e][i/128][p/128]
 * (likewise w2). One scale per expert is a block scale repeated over the expert's blocks. The layer is then:
 *   x is quantised once on its own rank, per 1 x 128 block of each row: a = max(amax of the block, 1e-30),
 *     q = e4m3(x * (448 / a)) (round to nearest even, saturating; fp32 arithmetic), s = a / 448, x̂ = q * s;
 *   gate|up = x̂ · w1ᵀ (fp32 accumulation), h = silu(gate) * up in fp32, quantised as x per 1 x 128 block of its row
 *     (instead of rounded to bf16): ĥ;
 *   y = ĥ · w2ᵀ (fp32 accumulation), and out as above (weight * y summed in fp32 in slot order).
 *   Accuracy: the cpu backend computes this in fp32 (the fp64 reference in fp64 but for the quantisation, done in
 *   fp32 as above), within 1e-2 relative (Frobenius) of each other. The cuda backend sums as its FP8 grouped GEMM does
 *   (the tensor cores' fp8 sums, promoted to fp32 every 128 k: relative error up to about 2e-3 per GEMM) and rounds y
 *   to bf16 before the combine; where its sums differ, a value of h near an e4m3 rounding boundary rounds the other
 *   way, so its out is within 3e-2 of the reference (about 1e-2 where the sums are 1e-3 apart). Against the bf16 layer
 *   on the dequantised weights, the quantisation of x and h moves out by a few percent (e4m3 keeps 3 mantissa bits).
 *   The dispatch carries hidden bytes + hidden/128 fp32 scales per routed row (bf16: 2*hidden bytes).
 *   w1_scale and w2_scale are required with FP8 weights and refused without them. cuda backend: hidden a multiple of
 *   16 and ffn a multiple of 128 (the FP8 grouped GEMM's rows and its SwiGLU tiles' 128-row scale blocks); per routed
 *   row the workspace holds 3*hidden + ffn + 4*(hidden/128 + ffn/128) + 16 bytes (bf16: 4*hidden + 2*ffn + 16).
 *   Not in the backward (tandem_moe_ffn_backward_args_t has no w_dtype: pass bf16 weights; its dtype FP8 is
 *   refused). tandem_moe_dispatch_gemm takes FP8 weights the same way (its w_dtype and w_scale). */
typedef struct tandem_moe_ffn_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t tokens, hidden, ffn, experts, topk;
  tandem_tensor_t x, topk_ids, topk_weights, w1, w2, out;
  void* cuda_stream;
  /* appended after 0.2.x; struct_size tells whether a caller has them */
  uint64_t saved_rows; /* rows of saved (this rank's); 0: no saved activations */
  tandem_tensor_t saved; /* output [saved_rows, 2*ffn] dtype: the routed rows' gate|up (see above) */
  /* appended after saved: FP8 weights (see "FP8 weights" above) */
  tandem_dtype_t w_dtype;             /* w1's and w2's dtype: 0 (dtype's) or TANDEM_DTYPE_FP8_E4M3 */
  tandem_tensor_t w1_scale, w2_scale; /* fp32 128 x 128 block scales; FP8 w_dtype only */
} tandem_moe_ffn_args_t;
TANDEM_API tandem_status_t tandem_moe_dispatch_ffn_combine(tandem_comm_t comm, const tandem_moe_ffn_args_t* args,
                                                           tandem_op_t* op);

/* The backward of tandem_moe_dispatch_ffn_combine (expert-parallel training). Every rank passes the forward's
 * inputs as it passed them (x, topk_ids, topk_weights, w1, w2, the same dims) and dout [tokens, hidden], the
 * gradient of the loss with respect to the forward's out. With a = x·w1_gateᵀ, b = x·w1_upᵀ, h = silu(a) * b
 * (rounded to dtype, as the forward) and y = h·w2ᵀ for each (token, slot) routed to expert e, this rank receives:
 *   dx [tokens, hidden]: Σ_slot (da·w1_gate + db·w1_up), summed over the token's slots in slot order, where
 *     dh = weight * (dout_t·w2), da = dh * b * silu'(a), db = dh * silu(a) (the rounding of h passes the gradient
 *     through unchanged);
 *   dtopk_weights [tokens, topk] fp32: dout_t·y = (dout_t·w2)·h;
 *   dw1 [E/n, 2*ffn, hidden] and dw2 [E/n, hidden, ffn]: the gradients of this rank's experts, summed over every
 *     rank's (token, slot) routed to them in (source rank, token, slot) order: dw1_gate += da xᵀ, dw1_up += db xᵀ,
 *     dw2 += (weight * dout_t) hᵀ. An expert that receives no row gets zeros.
 * The sums run in that fixed order (fp32 on the cpu backend, each output rounded to its dtype once), so the
 * results repeat bit for bit. Routing, its checks and their messages are the forward's: a bad or repeated expert
 * id fails the op alone, nothing is written, and the communicator stays usable. tokens may be 0 on a rank.
 * SwiGLU's backward needs a and b of every routed row. Two ways to have them (tandemd holds no state between ops):
 *   recomputed (saved_rows 0, the default): the op dispatches x and dout to the experts' ranks (2 * hidden values
 *     per routed row, the forward's one) and recomputes a, b and h there: per routed row 2*ffn*hidden multiply-adds
 *     to recompute, then 6*ffn*hidden for dout·w2, dw2, dw1 and dx, 8*ffn*hidden in all, about 2.7 times the
 *     forward's 3*ffn*hidden. No memory between forward and backward.
 *   saved (saved_rows > 0 and saved: the tensor the forward filled, see tandem_moe_ffn_args_t): a and b are read
 *     from saved at the row's index, so the recompute GEMM goes: 6*ffn*hidden multiply-adds per routed row (3/4 of
 *     the recompute mode's; twice the forward's). Costs 4*ffn bytes per routed row (bf16/fp16) held by the caller
 *     from the forward to the backward: 8 KiB a row at DeepSeek-V3's ffn 2048, 2 * tokens * topk * ffn * 2 bytes a
 *     rank with balanced routing. x is still dispatched with dout (dw1 = d(gate|up)ᵀ·x needs it on the expert's rank):
 *     saving x as well would add 2*hidden bytes a row (14 KiB at hidden 7168, 2.75 times the saved memory) to save
 *     moving hidden values a row, which costs far less than the GEMM. The routing is recomputed from topk_ids, so the
 *     backward's rows are the forward's only if every rank passes the forward's topk_ids, x and w1 unchanged: a saved
 *     tensor from another call gives wrong gradients. What can be checked is: saved [saved_rows, 2*ffn] in dtype,
 *     and the rows routed to this rank must fit saved_rows (else the op fails alone naming the rows, as the forward
 *     would have); saved given with saved_rows 0 is refused.
 * It sends back hidden + 1 values per row (dx, dtopk_weights).
 * cuda backend (ranks on one node, both executors, capturable in a CUDA graph as the forward): the forward's rules
 *   (bf16/fp16, hidden and ffn multiples of 8, topk <= 32, the routing and its errors decided on the GPU). a and b
 *   are rounded to dtype before h (the forward's epilogue takes them in fp32), and so are da, db and each slot's dx
 *   before dx's fp32 sum in slot order; dtopk_weights is summed in fp32. The routed rows live in the workspace:
 *   4*hidden + 8*ffn + 24 bytes per row on its expert's rank (the forward's: 4*hidden + 2*ffn + 16), and an op whose
 *   rows do not fit fails alone, naming the workspace to declare. A failed or rejected op writes none of dx,
 *   dtopk_weights, dw1 and dw2. Results repeat bit for bit. With saved: the same workspace per row (d(gate|up) is
 *   written there, saved is only read); the forward's gemm1 then stores gate|up into saved (rounded) and a separate
 *   pass gives h, in place of the fused SwiGLU epilogue; the backward computes what the recompute mode computes (a
 *   and b from the same grouped GEMM, rounded alike), without that GEMM. */
typedef struct tandem_moe_ffn_backward_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t tokens, hidden, ffn, experts, topk;
  tandem_tensor_t x, topk_ids, topk_weights, w1, w2, dout; /* the forward's inputs, and out's gradient */
  tandem_tensor_t dx, dtopk_weights, dw1, dw2;             /* outputs */
  void* cuda_stream;
  /* appended after 0.2.x; struct_size tells whether a caller has them */
  uint64_t saved_rows;   /* the forward's saved_rows; 0: gate|up is recomputed */
  tandem_tensor_t saved; /* input [saved_rows, 2*ffn] dtype: what the forward wrote there */
} tandem_moe_ffn_backward_args_t;
TANDEM_API tandem_status_t tandem_moe_dispatch_ffn_combine_backward(tandem_comm_t comm,
                                                                    const tandem_moe_ffn_backward_args_t* args,
                                                                    tandem_op_t* op);

/* Ring attention. The sequence is sharded over the ranks: this rank holds q, k, v [seq, heads, head_dim] for
 * its `seq` positions (ranks may differ). out [seq, heads, head_dim] = softmax(q·Kᵀ * scale [+ causal mask])
 * · V over the whole sequence, per head. scale 0 means 1/sqrt(head_dim). causal: position i attends to
 * positions j <= i (global positions). seq may be 0 on a rank.
 * layout says which global positions a rank's rows are (every rank passes the same):
 *   TANDEM_ATTENTION_CONTIGUOUS (0, the default): rank order, starting at the sum of lower ranks' seq;
 *   TANDEM_ATTENTION_ZIGZAG: the sequence is cut into 2n chunks (n ranks) and rank r holds chunk r (its first
 *     ceil(seq / 2) rows) and chunk 2n-1-r (the rest), so every rank has a like share of causal work.
 *     Chunk c < n is as long as ceil(seq_c / 2), chunk 2n-1-r as floor(seq_r / 2).
 * lse (optional; NULL buffer = not written): fp32 [heads, seq], the natural log of Σ_j exp(scale · q_i·k_j)
 * over the keys row i sees, which a backward pass (or a merge with other partial attentions) needs.
 * lse and layout were appended after 0.2.0 (CHANGELOG.md): a caller whose struct_size ends before them
 * (built against 0.2.0) gets no lse and the contiguous layout. */
typedef enum tandem_attention_layout {
  TANDEM_ATTENTION_CONTIGUOUS = 0,
  TANDEM_ATTENTION_ZIGZAG = 1,
} tandem_attention_layout_t;
typedef struct tandem_ring_attention_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t seq, heads, head_dim;
  int causal;
  float scale;
  tandem_tensor_t q, k, v, out;
  void* cuda_stream;
  /* appended after 0.2.0; struct_size tells whether a caller has them */
  tandem_tensor_t lse;
  tandem_attention_layout_t layout;
  /* appended after 0.2.x: grouped-query attention. k and v are [seq, kv_heads, head_dim]; kv_heads divides
   * heads and query head h attends with KV head h / (heads / kv_heads). 0 (or a struct_size that ends before
   * it) means kv_heads = heads. */
  uint64_t kv_heads;
} tandem_ring_attention_args_t;
TANDEM_API tandem_status_t tandem_ring_attention(tandem_comm_t comm, const tandem_ring_attention_args_t* args,
                                                 tandem_op_t* op);

/* Ring attention's backward. Given the forward's inputs q, k, v (as tandem_ring_attention took them: this
 * rank's rows, the same heads, kv_heads, causal, layout and scale on every rank), its output o and lse, and
 * dout, the gradient of the loss with respect to o, this rank receives dq (the gradient of its q rows), and dk
 * and dv (of its k and v rows, summed over every rank's queries and, with kv_heads < heads, over each KV head's
 * group of query heads). Every tensor is this rank's rows; lse is [heads, seq] fp32, as the forward wrote it
 * (pass the forward's o and lse unchanged: the gradients are computed from them). The sums run in a fixed
 * order, so the results repeat bit for bit. seq may be 0 on a rank.
 * cuda backend (ranks on one node, both executors, with the same bits): bf16 or fp16, head_dim 64 or 128,
 * 16-byte aligned tensors; each rank's gradients sum the attention backward core over every chunk pair in fp32
 * and are rounded once. With the client executor the call returns once tandemd has seen every rank submit the
 * op (each rank's launch needs every rank's seq), and each rank's q, k, v, o, dout and lse are copied into its
 * communicator workspace for its peers (a larger seq than it holds is refused, naming the workspace_bytes to
 * declare); it cannot be captured into a CUDA graph on several ranks (TANDEM_ERROR_UNSUPPORTED, saying why).
 * Across nodes: cpu backend only. */
typedef struct tandem_ring_attention_backward_args {
  size_t struct_size;
  tandem_dtype_t dtype;
  uint64_t seq, heads, head_dim; /* seq: this rank's rows */
  uint64_t kv_heads;             /* 0: heads */
  int causal;
  tandem_attention_layout_t layout;
  float scale; /* the forward's: 0 means 1/sqrt(head_dim) */
  tandem_tensor_t q, k, v, o, dout, lse; /* o: the forward's out */
  tandem_tensor_t dq, dk, dv; /* outputs: [seq, heads, head_dim], [seq, kv_heads, head_dim] twice */
  void* cuda_stream;
} tandem_ring_attention_backward_args_t;
TANDEM_API tandem_status_t tandem_ring_attention_backward(tandem_comm_t comm,
                                                          const tandem_ring_attention_backward_args_t* args,
                                                          tandem_op_t* op);

/* Barrier: completes once every rank has submitted it (ops before it on this communicator have completed).
 * cuda backend: in stream order on cuda_stream (a cudaStream_t; NULL = the legacy default stream): the stream
 * proceeds once every rank's stream has reached it. The cpu backend ignores cuda_stream. */
typedef struct tandem_barrier_args {
  size_t struct_size;
  void* cuda_stream;
} tandem_barrier_args_t;
TANDEM_API tandem_status_t tandem_barrier_stream(tandem_comm_t comm, const tandem_barrier_args_t* args,
                                                 tandem_op_t* op);
/* tandem_barrier_stream with cuda_stream NULL (the legacy default stream). */
TANDEM_API tandem_status_t tandem_barrier(tandem_comm_t comm, tandem_op_t* op);

/* AllGather of raw bytes: recv [nranks * bytes] receives every rank's send [bytes] in rank order.
 * cuda backend: stream-ordered on cuda_stream (a cudaStream_t; NULL = the legacy default stream): it reads
 * send after the work enqueued before it and later work sees recv. The call returns at once; tandem_wait (or
 * the stream) says when it is done. The rank's GPU is the device that was current at tandem_comm_init; ops
 * on one communicator must be ordered with each other (use one stream per communicator, as with NCCL). If
 * tandemd or a peer dies, the stream is released and the op fails (DAEMON_LOST, PEER_LOST or ABORTED). */
typedef struct tandem_allgather_args {
  size_t struct_size;
  tandem_tensor_t send, recv;
  uint64_t bytes; /* per rank */
  void* cuda_stream;
} tandem_allgather_args_t;
TANDEM_API tandem_status_t tandem_allgather(tandem_comm_t comm, const tandem_allgather_args_t* args, tandem_op_t* op);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_TANDEM_H_ */
