// Plain data shared by host code (g++) and kernels (nvcc): the host-visible error slot every device-side
// wait reports through, and the flag conventions of every fused op.
#pragma once

#include <cstdint>

namespace tandem::kernels {

// Flags and counters are monotonic uint64 values that are never reset: op n of a communicator waits for
// `flag >= epoch(n)`. kAbortValue is larger than every epoch, so writing it releases every waiter (the
// client library writes it when the daemon dies, the daemon when a peer dies).
inline constexpr uint64_t kAbortValue = ~uint64_t{0};

// kMoeRouting / kMoeCapacity are not waits but data errors of one op: the MoE kernels report a bad expert id or a
// capacity overflow found on the GPU in that op's OpFault (below), never in the ErrorSlot, so the communicator lives on.
// kDiverged: an op's entry in device-epoch mode (op_entry.hpp) found a peer on another op (another epoch or shape).
enum class WaitError : uint32_t { kNone = 0, kTimeout = 1, kAborted = 2, kMoeRouting = 3, kMoeCapacity = 4,
                                  kDiverged = 5 };

// Roles a CTA can take in a persistent fused kernel (one role table per kernel family).
enum class Role : uint32_t { kCompute = 0, kIntraComm = 1, kInterSend = 2, kInterReduce = 3, kReduce = 4 };

// Written once by the first wait that fails, in host-mapped memory; the host turns it into an Error
// "{op} {role} rank {rank}: waited for flag >= {expected}, saw {observed}".
inline constexpr uint32_t kErrorSlotWriting = 2;  // claimed, fields being written
inline constexpr uint32_t kErrorSlotReady = 1;    // every field written (release); read the slot only then
struct alignas(64) ErrorSlot {
  uint32_t claimed;   // 0 = empty; the first failing thread sets kErrorSlotWriting (atomicCAS), fills the rest, then
                      // stores kErrorSlotReady with release
  uint32_t code;      // WaitError
  uint32_t op;        // OpKind
  uint32_t role;      // Role
  uint32_t rank;
  uint32_t chunk;     // which flag (chunk or tile index)
  uint64_t expected;
  uint64_t observed;
};
static_assert(sizeof(ErrorSlot) == 64);

// A data error of one op (a bad expert id, a capacity overflow): the op fails on every rank and writes nothing, and
// the communicator stays usable. Unlike the ErrorSlot (one per rank, first failure wins, fails the communicator) there
// is one per epoch in a ring (CommControl::faults), written by one thread: the fields, then `epoch` with release. The
// host reads entry e % ring when it completes op e, and trusts it only if `epoch` equals e (an older op's fault in the
// same entry carries an older epoch).
struct alignas(32) OpFault {
  uint64_t epoch;    // 0 = none; the failed op's epoch, stored last (release)
  uint32_t code;     // WaitError::kMoeRouting or kMoeCapacity
  uint32_t atFault;  // the rank whose ids or capacity caused it
  uint32_t chunk;    // kMoeRouting: the token; kMoeCapacity: the rows the rank holds
  uint32_t op;       // OpKind
  uint64_t observed; // kMoeRouting: bit 62 repeat, bits 32..61 slot, low 32 bits the id; kMoeCapacity: rows received,
                     // bit 63 set when the limit (chunk) was the rank's saved_rows rather than its receive rows
};
static_assert(sizeof(OpFault) == 32);

}  // namespace tandem::kernels
