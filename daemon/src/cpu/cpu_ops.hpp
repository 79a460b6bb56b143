// The CPU reference backend's op implementations: every fused op, run on host memory that the daemon
// has mapped for each rank. It is the numerical reference for the GPU kernels, never presented as fast:
// fp32 accumulation, outputs rounded once to the output dtype.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tandem/common/descriptor.hpp"

namespace tandem::daemon {

// One rank's part of a collective op, every slot resolved to memory the daemon has mapped.
struct RankOp {
  OpDescriptor desc;                                // already passed validateDescriptor
  std::array<std::byte*, kMaxOpBuffers> data{};     // nullptr for absent optional slots
};

// Runs one collective op. ranks[r] is rank r; validateCollective has passed. Data-dependent problems
// (an expert id out of range, moe capacity too small) throw Error(kInvalidArgument) before any output is
// written. Safe to call from several threads on different ops.
void runCpuOp(std::span<const RankOp> ranks);

// True when the cpu backend implements `kind` (it must implement every op of the table).
bool cpuRuns(OpKind kind);

// An upper bound of the host scratch runCpuOp allocates for this collective (descs[r] is rank r's descriptor);
// UINT64_MAX when it would not even fit 64 bits. The backend refuses ops above limits.max_scratch_bytes.
uint64_t cpuScratchBytes(std::span<const OpDescriptor> descs);

// c[m, n] = a[m, k] · b[n, k]ᵀ in fp32, deterministic (fixed summation order). Shared with cpu_multinode.cpp.
void gemmNT(const float* a, const float* b, float* c, std::size_t m, std::size_t n, std::size_t k);

// Rank r's GEMM operand in fp32 as [rows, k] (K-major), whatever its stored layout: op(A) (rows of A) or op(B)
// (`isB`, rows = n). FP8 inputs are dequantized with their fp32 scales (value * scale, descriptor.hpp's
// kFlagFp8BlockScale); r.data needs the operand's slot and, for FP8, its scale slot. Shared with cpu_multinode.cpp.
std::vector<float> gemmOperand(const RankOp& r, bool isB, std::size_t rows, std::size_t k);

class CommLink;
// Runs one collective whose ranks live on several nodes (cpu_multinode.cpp). ranks[r].desc is every rank's
// descriptor; only ranks on this node (nodeOfRank[r] == link.self()) have data. Every op kind: ag-gemm, gemm-rs,
// gemm-ar, allgather and barriers hierarchically (one aggregated payload per node pair), MoE and ring attention by
// replicating the inputs to every node. Every node of the communicator calls it for the same collective with the
// same epoch.
void runCpuOpAcrossNodes(std::span<const RankOp> ranks, std::span<const uint32_t> nodeOfRank, CommLink& link,
                         uint64_t epoch);

}  // namespace tandem::daemon
