// Hopper (sm_90a) GEMM building blocks: PTX wrappers for mbarrier, TMA and wgmma, the shared-memory layout, the
// tile order (scheduler) and the producer / consumer bodies of a warp-specialised persistent GEMM.
// C[M,N] = A[M,K] * B[N,K]^T, A and B K-major, fp32 accumulation. No __global__ here: gemm.cu (and later the fused
// kernels) wire these pieces into kernels, plugging in their own tile order and "rows ready" wait.
//
// Block tile 128x256x64; warpgroup 0 is the TMA producer (one elected thread), warpgroups 1 and 2 are consumers, each
// owning 64 rows x 256 columns of the tile with one m64n256k16 wgmma per 16 of K (128 fp32 accumulators per thread).
// Stages are A 128x64 + B 256x64 (48 KiB), 128-byte swizzled exactly as TMA writes them and as wgmma reads them.
// Optional cluster of 2 CTAs along M: each CTA loads half of the shared B tile and multicasts it to both.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; nothing links libcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tandem::kernels::gemm {

// ---------------------------------------------------------------------------------------------------------------
// Geometry (shared by the host launcher; keep in sync with kernels/gemm.cu).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kBlockM = 128;
inline constexpr int kBlockN = 256;
inline constexpr int kBlockK = 64;        // 64 bf16 = 128 bytes = one 128B-swizzle row
inline constexpr int kMmaK = 16;
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;  // 64 = wgmma M
inline constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
inline constexpr int kStages = 4;
inline constexpr int kEpiCols = 64;       // TMA-store chunk: 64 rows x 64 columns (128-byte rows)
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
inline constexpr uint32_t kABytes = kBlockM * kBlockK * 2;
inline constexpr uint32_t kBBytes = kBlockN * kBlockK * 2;
static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <= 512, "register file: 64K regs / 128 threads");

enum class Role : uint8_t { kProducer = 0, kConsumer = 1 };
// Warpgroup 0 produces; the rest consume. wg must be warp-uniform (from __shfl_sync).
__host__ __device__ constexpr Role roleOf(int wg) { return wg == 0 ? Role::kProducer : Role::kConsumer; }

// Named barriers (bar.sync ids). 0 is __syncthreads.
enum class Barrier : uint32_t { kCta = 0, kConsumerEpilogue0 = 1, kConsumerEpilogue1 = 2 };

enum class Epilogue : uint8_t {
  kTmaStore = 0,  // registers -> swizzled smem (64x64 chunks, double-buffered) -> TMA store; edges clipped by TMA
  kDirect = 1,    // registers -> global, 4-byte stores, masked at the edges
  kCustom = 2,    // the fused kernel's EpiHook takes the accumulators (see NoEpiHook for the interface)
};

// ---------------------------------------------------------------------------------------------------------------
// Kernel parameters (POD, passed as const __grid_constant__ so the tensor maps live in param space).
// ---------------------------------------------------------------------------------------------------------------
struct GemmKernelParams {
  CUtensorMap tmA;  // A [M, K]: dims {K, M}, box {64, 128}, 128B swizzle
  CUtensorMap tmB;  // B [N, K]: dims {K, N}, box {64, 256 / clusterM}, 128B swizzle
  CUtensorMap tmC;  // C [M, N]: dims {N, M}, box {64, 64}, 128B swizzle (TMA-store epilogue)
  void* c;          // C base (direct epilogue)
  int64_t ldc;      // elements
  int32_t m, n, k;
  int32_t numKBlocks;  // ceil(k / 64)
  int32_t unitsM;      // ceil(ceil(m / 128) / clusterM): cluster rows of tiles
  int32_t tilesN;      // ceil(n / 256)
  int32_t groupM;      // raster group, in units of cluster rows
  int32_t pad0;
};
static_assert(sizeof(GemmKernelParams) % 64 == 0);

// ---------------------------------------------------------------------------------------------------------------
// Shared memory. Every operand buffer starts on 1024 bytes (the 128B swizzle atom is 8 rows x 128 bytes).
// ---------------------------------------------------------------------------------------------------------------
template <int Stages>
struct SharedStorage {
  alignas(1024) uint16_t a[Stages][kBlockM * kBlockK];
  alignas(1024) uint16_t b[Stages][kBlockN * kBlockK];
  alignas(1024) uint16_t c[kConsumerWarpgroups][2][kRowsPerConsumer * kEpiCols];
  alignas(8) uint64_t full[Stages];   // TMA bytes landed (1 arrival: the local producer's expect_tx)
  uint64_t empty[Stages];             // consumers done with the stage (kConsumerWarpgroups * clusterM arrivals)
};
// Dynamic shared memory to request: the struct plus slack to align the base to 1024.
template <int Stages>
inline constexpr size_t kSmemBytes = sizeof(SharedStorage<Stages>) + 1024;
static_assert(kSmemBytes<kStages> <= 227 * 1024, "H100/H200 opt-in shared memory per block");

// ---------------------------------------------------------------------------------------------------------------
// Tile order. An Order maps a linear work index to a (cluster row of tiles, tile column); numWork() bounds it.
// Each cluster takes work indices clusterId, clusterId + numClusters, ... in that order, so an Order fixes both the
// global raster and, roughly, the time at which each tile is computed. Fused ops bring their own (e.g. local shard
// first, then shards in arrival order).
// ---------------------------------------------------------------------------------------------------------------
struct TileCoord {
  int32_t unitM;  // cluster row: CTA rank r of the cluster computes tile row unitM * clusterM + r
  int32_t tileN;
};

// L2-friendly grouped raster: walk `group` cluster rows down, then the next tile column; then the next group.
struct GroupedRaster {
  int32_t unitsM, tilesN, group;
  __device__ __forceinline__ int32_t numWork() const { return unitsM * tilesN; }
  __device__ __forceinline__ TileCoord operator()(int32_t w) const {
    const int32_t perGroup = group * tilesN;
    const int32_t g = w / perGroup;
    const int32_t first = g * group;
    const int32_t size = min(unitsM - first, group);
    const int32_t r = w - g * perGroup;
    return {first + r % size, r / size};
  }
};

// "Before loading A rows [r0, r1)" hook, called by the producer thread once per tile before its first TMA load of A.
// The range may be empty (a cluster's second CTA past the last row). Fused ops wait on per-chunk ready flags here.
struct NoRowWait {
  __device__ __forceinline__ void operator()(int32_t /*r0*/, int32_t /*r1*/) const {}
};

// Epilogue::kCustom hook, called by every thread of a consumer warpgroup (128 threads, t = 0..127, warpgroup wg of 2):
//   tile(acc, rowBase, n0, wg, t, cbuf): the fp32 accumulators of rows [rowBase, rowBase + 64) x columns [n0, n0 + 256)
//     (wgmma m64n256 layout; only called when rowBase < M); cbuf is this warpgroup's epilogue smem, 2 x 8 KiB;
//     synchronise the warpgroup with namedBarSync(wg == 0 ? kConsumerEpilogue0 : kConsumerEpilogue1, 128).
//   finish(wg, t): once, after the warpgroup's last tile.
// Fused kernels bring their own (e.g. push partial tiles to a peer, or reduce received partials into the output).
struct NoEpiHook {
  __device__ __forceinline__ void tile(float (&)[128], int32_t, int32_t, int, int, uint16_t (&)[2][64 * 64]) {}
  __device__ __forceinline__ void finish(int, int) {}
};

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smemAddr(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy and to the other CTAs of the cluster.
__device__ __forceinline__ void fenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smemAddr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smemAddr(bar)) : "memory");
}
// Arrive on the barrier at the same offset in CTA `ctaRank` of this cluster. Default (.release.cta) semantics on
// purpose: the only thing published is "the wgmma reads of this stage are done" (wgmma.wait_group), which needs no
// memory fence; .release.cluster would put a MEMBAR.ALL.GPU on every k-block (seen in SASS, ~35% slower).
__device__ __forceinline__ void mbarArriveCluster(uint64_t* bar, uint32_t ctaRank) {
  asm volatile(
      "{\n.reg .b32 remAddr;\n"
      "mapa.shared::cluster.u32 remAddr, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remAddr];\n}\n" ::"r"(smemAddr(bar)),
      "r"(ctaRank)
      : "memory");
}
__device__ __forceinline__ bool mbarTryWait(uint32_t addr, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(addr), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits until the phase with this parity has completed (acquire). A fresh barrier counts its parity-1 phase as done.
__device__ __forceinline__ void mbarWait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smemAddr(bar);
  while (!mbarTryWait(addr, parity)) {
  }
}

__device__ __forceinline__ void prefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// 2D tile load, completing on `bar` (complete_tx bytes) of this CTA.
__device__ __forceinline__ void tmaLoad2d(const CUtensorMap* map, void* dst, uint64_t* bar, int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::
          "r"(smemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smemAddr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// Contiguous bytes global -> this CTA's shared memory, completing on `bar` (complete_tx bytes). Both addresses and
// `bytes` multiples of 16.
__device__ __forceinline__ void bulkLoad(void* dstSmem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smemAddr(dstSmem)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smemAddr(bar))
      : "memory");
}
// 2D tile load multicast to the CTAs in ctaMask: same smem offset and same barrier offset in each of them.
__device__ __forceinline__ void tmaLoad2dMulticast(const CUtensorMap* map, void* dst, uint64_t* bar, int32_t c0,
                                                   int32_t c1, uint16_t ctaMask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smemAddr(bar)), "r"(c0), "r"(c1), "h"(ctaMask)
      : "memory");
}
// 2D tile store from this CTA's smem; completion tracked by bulk groups of the issuing thread.
__device__ __forceinline__ void tmaStore2d(const CUtensorMap* map, uint32_t srcSmem, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(srcSmem), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void bulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulkWaitRead() {  // at most N groups still reading smem
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulkWait() {  // at most N groups not fully complete
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Generic-proxy smem writes (st.shared) become visible to the async proxy (TMA store) after this + a barrier.
__device__ __forceinline__ void fenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void namedBarSync(Barrier id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}
// The same for kernels with barrier enums of their own.
__device__ __forceinline__ void namedBarSyncId(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void stShared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t clusterCtaRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// All threads of all CTAs of the cluster; .aligned: every thread of the warp executes it together.
__device__ __forceinline__ void clusterSyncAligned() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void clusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

template <uint32_t N>
__device__ __forceinline__ void setMaxNRegDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <uint32_t N>
__device__ __forceinline__ void setMaxNRegInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

__device__ __forceinline__ void wgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the async wgmma window.
template <int R>
__device__ __forceinline__ void fenceAccumulators(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row core groups 1024 bytes apart.
// Advancing K by 16 elements (32 bytes) inside the 128-byte row adds 2 to the address field.
__device__ __forceinline__ uint64_t makeSmemDesc(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);  // start address
  d |= static_cast<uint64_t>(1) << 16;                // leading byte offset (unused for swizzled K-major)
  d |= static_cast<uint64_t>(1024 >> 4) << 32;        // stride byte offset: 8 rows x 128 bytes
  d |= static_cast<uint64_t>(1) << 62;                // 128-byte swizzle
  return d;
}

// The same for an MN-major operand (stored [K, N]: each row of the stored matrix holds one k for many columns), as
// TMA writes it in {64 columns, 64 k} boxes of 8 KiB: leading byte offset 8 KiB = the next 64 columns, stride byte
// offset 1024 = the next 8 k. One k-step of 16 advances 16 rows of 128 bytes (2048 bytes, 128 in the address field).
__device__ __forceinline__ uint64_t makeSmemDescMn(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((64 * 128) >> 4) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

// B's shared-memory form: the forward stores B as [N, K] (K-major, one TMA box of 256 rows per k-block); the
// dgrad's weight is [K, N] (MN-major, four {64 columns, 64 k} boxes per k-block, and wgmma's transpose bit for B).
template <bool BMn>
__device__ __forceinline__ uint64_t makeBDesc(uint32_t addr) {
  if constexpr (BMn) {
    return makeSmemDescMn(addr);
  } else {
    return makeSmemDesc(addr);
  }
}
template <bool BMn>
inline constexpr uint64_t kBDescKStep = BMn ? (kMmaK * 128) >> 4 : (kMmaK * 2) >> 4;

template <bool BMn>
__device__ __forceinline__ void tmaLoadB(const CUtensorMap* map, uint16_t* dst, uint64_t* bar, int32_t k0,
                                         int32_t n0) {
  if constexpr (BMn) {
#pragma unroll
    for (int j = 0; j < kBlockN / 64; ++j) tmaLoad2d(map, dst + j * 64 * kBlockK, bar, n0 + 64 * j, k0);
  } else {
    tmaLoad2d(map, dst, bar, k0, n0);
  }
}

template <class T, bool BMn = false>
struct Wgmma64x256;

#define TANDEM_WGMMA_64x256_SS(TY, TB)                                                                  \
  asm volatile(                                                                                      \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                                   \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "    \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "    \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "    \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "    \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "    \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "    \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "    \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "    \
      "%128, %129, p, 1, 1, 0, " TB ";\n}\n"\
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),  \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),  \
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),  \
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),  \
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),  \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),  \
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),  \
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),  \
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),  \
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),  \
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),  \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),  \
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),  \
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(descA), "l"(descB), "r"(scaleD))

// D[64x256] (+)= A[64x16] * B[256x16]^T, both from shared memory, A K-major, B K-major (BMn false) or MN-major
// (true: the instruction's transpose bit for B); scaleD == 0 overwrites D.
template <bool BMn>
struct Wgmma64x256<__nv_bfloat16, BMn> {
  __device__ __forceinline__ static void run(float (&d)[128], uint64_t descA, uint64_t descB, uint32_t scaleD) {
    if constexpr (BMn) {
      TANDEM_WGMMA_64x256_SS("bf16", "1");
    } else {
      TANDEM_WGMMA_64x256_SS("bf16", "0");
    }
  }
};
template <bool BMn>
struct Wgmma64x256<__half, BMn> {
  __device__ __forceinline__ static void run(float (&d)[128], uint64_t descA, uint64_t descB, uint32_t scaleD) {
    if constexpr (BMn) {
      TANDEM_WGMMA_64x256_SS("f16", "1");
    } else {
      TANDEM_WGMMA_64x256_SS("f16", "0");
    }
  }
};
#undef TANDEM_WGMMA_64x256_SS

template <class T>
__device__ __forceinline__ uint32_t packPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t packPair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t packPair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---------------------------------------------------------------------------------------------------------------
// Pipeline position: stage index and the parity of the pass over the ring. Producer and consumers walk the same
// sequence of (tile, k-block), so their positions agree.
// ---------------------------------------------------------------------------------------------------------------
template <int Stages>
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == Stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Called once by thread 0 before the roles start; the CTA (or cluster) must sync afterwards.
template <int Stages, int ClusterM>
__device__ __forceinline__ void initBarriers(SharedStorage<Stages>& s) {
#pragma unroll
  for (int i = 0; i < Stages; ++i) {
    mbarInit(&s.full[i], 1);
    mbarInit(&s.empty[i], kConsumerWarpgroups * ClusterM);
  }
  fenceBarrierInit();
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread. For each tile of this cluster, waits on rowWait for its A rows, then streams k-blocks into
// the ring: wait for the stage to be empty (in every CTA of the cluster), announce the bytes, issue the TMA loads.
// ---------------------------------------------------------------------------------------------------------------
template <int Stages, int ClusterM, class Order, class RowWait, bool BMn = false>
__device__ __forceinline__ void runProducer(const GemmKernelParams& p, SharedStorage<Stages>& s, const Order& order,
                                            const RowWait& rowWait, int32_t firstWork, int32_t workStride,
                                            uint32_t ctaRank) {
  static_assert(!BMn || ClusterM == 1, "an MN-major B is loaded whole by each CTA (no multicast halves)");
  constexpr int kBRowsPerCta = kBlockN / ClusterM;
  constexpr uint32_t kBHalfBytes = kBBytes / ClusterM;
  PipeState<Stages> ps;
  const int32_t numWork = order.numWork();
  for (int32_t w = firstWork; w < numWork; w += workStride) {
    const TileCoord tc = order(w);
    const int32_t m0 = (tc.unitM * ClusterM + static_cast<int32_t>(ctaRank)) * kBlockM;
    const int32_t n0 = tc.tileN * kBlockN;
    const bool aValid = m0 < p.m;  // a cluster's last CTA may lie wholly past M: load no A, store nothing
    // Which B slices exist (a slice wholly past N is neither loaded nor expected, on every CTA alike).
    uint32_t bytes = aValid ? kABytes : 0;
#pragma unroll
    for (int r = 0; r < ClusterM; ++r) bytes += (n0 + r * kBRowsPerCta < p.n) ? kBHalfBytes : 0;
    const bool myBValid = n0 + static_cast<int32_t>(ctaRank) * kBRowsPerCta < p.n;
    rowWait(min(m0, p.m), min(m0 + kBlockM, p.m));
    for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
      // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete.
      mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
      mbarArriveExpectTx(&s.full[ps.stage], bytes);
      const int32_t k0 = kb * kBlockK;
      if (aValid) tmaLoad2d(&p.tmA, s.a[ps.stage], &s.full[ps.stage], k0, m0);
      if constexpr (ClusterM == 1) {
        tmaLoadB<BMn>(&p.tmB, s.b[ps.stage], &s.full[ps.stage], k0, n0);
      } else {
        if (myBValid) {
          tmaLoad2dMulticast(&p.tmB, s.b[ps.stage] + ctaRank * kBRowsPerCta * kBlockK, &s.full[ps.stage], k0,
                             n0 + static_cast<int32_t>(ctaRank) * kBRowsPerCta,
                             static_cast<uint16_t>((1u << ClusterM) - 1));
        }
      }
      ps.advance();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup `wg` (0 or 1): rows [64 wg, 64 wg + 64) of each tile. t = thread index within the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int Stages, int ClusterM>
__device__ __forceinline__ void releaseStage(SharedStorage<Stages>& s, int stage, int t) {
  // The wgmma reading this stage completed (wgmma.wait_group by this warpgroup): hand the slot back to every
  // producer that writes into it. Pairs with the producer's mbarWait(empty).
  if constexpr (ClusterM == 1) {
    if (t == 0) mbarArrive(&s.empty[stage]);
  } else {
    if (t % 64 == 0 && t / 64 < ClusterM) mbarArriveCluster(&s.empty[stage], static_cast<uint32_t>(t / 64));
  }
}

template <class T, int Stages, int ClusterM, Epilogue Epi, class Order, class EpiHook = NoEpiHook, bool BMn = false>
__device__ __forceinline__ void runConsumer(const GemmKernelParams& p, SharedStorage<Stages>& s, const Order& order,
                                            int32_t firstWork, int32_t workStride, uint32_t ctaRank, int wg, int t,
                                            EpiHook epiHook = EpiHook{}) {
  static_assert(ClusterM == 1 || ClusterM == 2);
  float acc[128];
  PipeState<Stages> ps;
  uint32_t epiChunks = 0;  // TMA-store chunks committed so far by this warpgroup (thread 0 tracks the groups)
  const uint32_t aOffset = static_cast<uint32_t>(wg) * kRowsPerConsumer * kBlockK * 2;
  const Barrier epiBar = wg == 0 ? Barrier::kConsumerEpilogue0 : Barrier::kConsumerEpilogue1;
  const int warp = t / 32;
  const int lane = t % 32;
  const int32_t numWork = order.numWork();

  for (int32_t w = firstWork; w < numWork; w += workStride) {
    const TileCoord tc = order(w);
    const int32_t m0 = (tc.unitM * ClusterM + static_cast<int32_t>(ctaRank)) * kBlockM;
    const int32_t n0 = tc.tileN * kBlockN;

    // ---- mainloop: one k-block in flight behind the one being issued.
    int prevStage = 0;
    for (int32_t kb = 0; kb < p.numKBlocks; ++kb) {
      mbarWait(&s.full[ps.stage], ps.phase);  // acquire: TMA bytes of this stage landed
      const uint64_t descA = makeSmemDesc(smemAddr(s.a[ps.stage]) + aOffset);
      const uint64_t descB = makeBDesc<BMn>(smemAddr(s.b[ps.stage]));
      fenceAccumulators(acc);
      wgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / kMmaK; ++kk) {
        Wgmma64x256<T, BMn>::run(acc, descA + 2 * kk, descB + kBDescKStep<BMn> * kk, (kb > 0 || kk > 0) ? 1u : 0u);
      }
      wgmmaCommit();
      fenceAccumulators(acc);
      wgmmaWait<1>();  // the previous k-block's wgmmas are done: its stage can be refilled
      if (kb > 0) releaseStage<T, Stages, ClusterM>(s, prevStage, t);
      prevStage = ps.stage;
      ps.advance();
    }
    wgmmaWait<0>();
    fenceAccumulators(acc);
    if (p.numKBlocks > 0) releaseStage<T, Stages, ClusterM>(s, prevStage, t);

    // ---- epilogue
    const int32_t rowBase = m0 + wg * kRowsPerConsumer;
    if (rowBase >= p.m) continue;  // warpgroup-uniform: nothing of ours lies inside C
    if constexpr (Epi == Epilogue::kTmaStore) {
      const int r = warp * 16 + lane / 4;  // accumulator rows r and r + 8 (same swizzle phase r & 7)
      const uint32_t rowOff0 = static_cast<uint32_t>(r) * 128;
      const uint32_t rowOff1 = static_cast<uint32_t>(r + 8) * 128;
      const uint32_t phase = static_cast<uint32_t>(r & 7);
#pragma unroll
      for (int c = 0; c < kBlockN / kEpiCols; ++c) {
        if (n0 + c * kEpiCols >= p.n) break;  // uniform: the rest of the tile lies past N
        const uint32_t buf = epiChunks & 1;
        if (epiChunks >= 2) {
          // The store issued from this buffer two chunks ago must have finished reading it.
          if (t == 0) bulkWaitRead<1>();
          namedBarSync(epiBar, 128);
        }
        const uint32_t base = smemAddr(s.c[wg][buf]);
#pragma unroll
        for (int jj = 0; jj < kEpiCols / 8; ++jj) {
          const int j = c * (kEpiCols / 8) + jj;
          // 128B swizzle: 16-byte chunk index XOR (row & 7), as the TMA store map expects.
          const uint32_t col = ((static_cast<uint32_t>(jj) ^ phase) << 4) + static_cast<uint32_t>(lane & 3) * 4;
          stShared32(base + rowOff0 + col, packPair<T>(acc[4 * j + 0], acc[4 * j + 1]));
          stShared32(base + rowOff1 + col, packPair<T>(acc[4 * j + 2], acc[4 * j + 3]));
        }
        fenceProxyAsyncShared();   // our st.shared -> visible to the TMA engine
        namedBarSync(epiBar, 128);  // publishes the whole 64x64 chunk to thread 0
        if (t == 0) {
          tmaStore2d(&p.tmC, base, n0 + c * kEpiCols, rowBase);
          bulkCommit();
        }
        ++epiChunks;
      }
    } else if constexpr (Epi == Epilogue::kCustom) {
      epiHook.tile(acc, rowBase, n0, wg, t, s.c[wg]);
    } else {
      T* const cBase = static_cast<T*>(p.c);
      const int32_t row0 = rowBase + warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int32_t col = n0 + j * 8 + (lane & 3) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t row = row0 + 8 * h;
          if (row < p.m && col < p.n) {
            T* const dst = cBase + static_cast<int64_t>(row) * p.ldc + col;
            if (col + 1 < p.n) {
              *reinterpret_cast<uint32_t*>(dst) = packPair<T>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            } else {
              const uint32_t v = packPair<T>(acc[4 * j + 2 * h], 0.0f);
              *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(v & 0xFFFF);
            }
          }
        }
      }
    }
  }
  if constexpr (Epi == Epilogue::kTmaStore) {
    if (t == 0) bulkWait<0>();  // smem must outlive the last stores' reads; global writes complete with the grid
  }
  if constexpr (Epi == Epilogue::kCustom) epiHook.finish(wg, t);
}

// ---------------------------------------------------------------------------------------------------------------
// A whole GEMM CTA: call from a __global__ with __launch_bounds__(kThreads, 1), all kThreads threads, dynamic smem of
// kSmemBytes<kStages>, launched in clusters of ClusterM along x. This CTA is worker `clusterId` of `numClusters`
// (clusters, not CTAs) and takes work indices clusterId, clusterId + numClusters, ... of `order`. A fused kernel that
// gives some CTAs other roles passes its compute-CTA numbering here, its own Order, and a RowWait that blocks until the
// A rows it is asked about have landed (the producer thread calls it; use waitUntil there).
// ---------------------------------------------------------------------------------------------------------------
template <class T, int ClusterM, Epilogue Epi, class Order, class RowWait, class EpiHook = NoEpiHook>
__device__ __forceinline__ void runGemmCta(const GemmKernelParams& p, uint8_t* smemRaw, const Order& order,
                                           const RowWait& rowWait, int32_t clusterId, int32_t numClusters,
                                           EpiHook epiHook = EpiHook{}) {
  auto& s = *reinterpret_cast<SharedStorage<kStages>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                         ~static_cast<uintptr_t>(1023));
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  const uint32_t ctaRank = ClusterM > 1 ? clusterCtaRank() : 0u;

  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads (checked there too)
    initBarriers<kStages, ClusterM>(s);
    prefetchTensorMap(&p.tmA);
    prefetchTensorMap(&p.tmB);
    if constexpr (Epi == Epilogue::kTmaStore) prefetchTensorMap(&p.tmC);
  }
  // Barriers initialised before any thread (or any peer CTA's multicast / remote arrive) uses them.
  if constexpr (ClusterM > 1) {
    clusterSyncAligned();
  } else {
    __syncthreads();
  }

  switch (roleOf(wg)) {
    case Role::kProducer:
      setMaxNRegDec<kProducerRegs>();
      if (t == 0) runProducer<kStages, ClusterM>(p, s, order, rowWait, clusterId, numClusters, ctaRank);
      break;
    case Role::kConsumer:
      setMaxNRegInc<kConsumerRegs>();
      runConsumer<T, kStages, ClusterM, Epi>(p, s, order, clusterId, numClusters, ctaRank, wg - 1, t, epiHook);
      break;
  }
  if constexpr (ClusterM > 1) {
    // No CTA may leave while a peer can still multicast into its smem or arrive on its barriers.
    __syncwarp();
    clusterSync();
  }
}

}  // namespace tandem::kernels::gemm
