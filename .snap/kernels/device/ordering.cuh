// Every memory-ordering operation the kernels use, in one place, named <op><Semantic><Scope>.
// Scopes: Gpu (this device), Sys (other devices over NVLink and the host). No bare volatile,
// __threadfence or ordering asm anywhere else: call these and name the pairing at the call site.
#pragma once

#include <cstdint>

namespace tandem::kernels {

__device__ __forceinline__ uint64_t ldAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ldAcquireGpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ldRelaxedSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void stReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void stRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void redAddReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void redAddReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void fenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ void fenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// Generic-proxy writes (st, or data landed from a peer) must be fenced before the async proxy (TMA,
// wgmma operand reads) reads the same global memory.
__device__ __forceinline__ void fenceProxyAsyncGlobal() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ uint64_t globaltimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}


// ---- appended for the runtime (allgather, persistent executor) ----
__device__ __forceinline__ uint32_t ldAcquireSysU32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stReleaseSysU32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void stRelaxedSysU32(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Returns the old value; acq_rel: publishes this thread's prior writes and acquires those of earlier adders.
__device__ __forceinline__ uint64_t fetchAddAcqRelGpu(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
// Sequentially consistent fence: a store before it and a load after it cannot be reordered (Dekker handshakes
// with the host, which pairs it with a seq_cst fence of its own).
__device__ __forceinline__ void fenceScSys() { asm volatile("fence.sc.sys;" ::: "memory"); }


// ---- appended for gemm_rs / gemm_ar (in-CTA hand-off between consumer warpgroups and copier warps) ----
// Shared-memory words, CTA scope: the consumer warpgroup publishes "half tile i is written" to the copier warps.
__device__ __forceinline__ void stReleaseCtaSharedU32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.cta.shared.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(v)
               : "memory");
}
__device__ __forceinline__ uint32_t ldAcquireCtaSharedU32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.cta.shared.u32 %0, [%1];" : "=r"(v) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p)))
               : "memory");
  return v;
}
// Hint: bring the 128-byte line holding p into L2 ahead of a later read.
__device__ __forceinline__ void prefetchL2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// ---- appended for the proxy FIFO's device producer (proxy_push.cuh) ----
// Returns the old value. Relaxed, system scope: a ticket counter that host threads may share; it orders nothing.
__device__ __forceinline__ uint64_t fetchAddRelaxedSys(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.relaxed.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

}  // namespace tandem::kernels
