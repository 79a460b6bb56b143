// Attention backward building blocks (FlashAttention-2 style, recomputing P from the forward's log-sum-exp). No
// __global__ here: attention_bwd.cu wires these into kernels.
//
// With S = q K^T, P = exp(scale S - lse), dP = dO V^T, D = rowsum(dO * O) and dS = P * (dP - D):
//   dV = P^T dO,  dK = scale dS^T Q,  dQ = scale dS K.
// Three passes:
//   1. prepareRows: per (head, row) D and lse * log2(e) into the workspace (rows padded to kRowPad: padded rows get
//      D = 0 and lse = +inf, so that their P is 0 and the main loops need no row bounds).
//   2. runKvBlock (one CTA per KV block of kBlockKv keys and KV head): K and V stay in shared memory; the CTA walks
//      every query head of the KV head's group and every query block that sees the keys, in a fixed order, and keeps
//      dK and dV in registers. Each of its 8 warps owns 16 keys and computes S^T and dP^T for them directly (K and V
//      as the A operand), so that P^T and dS^T leave the accumulators already in the A-fragment layout of dV += P^T dO
//      and dK += dS^T Q: no shared-memory round trip. In atomic dq mode dS^T also goes to shared memory and the CTA
//      adds dS K into an fp32 workspace with atomics.
//   3. runQBlock (deterministic dq mode; one CTA per query block of kBlockQ rows and query head): the same S, P, dP
//      and dS recomputed with each warp owning 16 query rows, and dQ += dS K summed over the KV blocks in order.
//      Bitwise repeatable; 7 matrix products per block pair in all instead of 5.
// Matrix products: mma.sync m16n8k16 (sm_80 style, fp32 accumulators), operands through ldmatrix from shared memory
// tiles with rows padded by 16 bytes (row stride = 4 banks mod 32: the 8 row addresses of an 8x8 ldmatrix hit 8
// distinct 16-byte bank groups). Loads: cp.async, two stages of the per-iteration tiles.
// NOTE: wgmma (as the forward uses) would be the faster path on Hopper; this core trades that for a design whose
// fragment layouts are all the documented mma.sync ones.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tandem::kernels::attn_bwd {

// ---------------------------------------------------------------------------------------------------------------
// Geometry (shared with the host launcher in attention_bwd.cu).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kWarps = 8;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kBlockKv = 16 * kWarps;  // keys per dk/dv CTA: 16 per warp
inline constexpr int kBlockQIter = 64;        // query rows per step of the dk/dv CTA
inline constexpr int kBlockQ = 16 * kWarps;   // query rows per dq CTA: 16 per warp
inline constexpr int kBlockKvIter = 64;       // keys per step of the dq CTA
inline constexpr int kRowPad = 128;           // the workspace's rows per head are padded to this (>= both blocks)
inline constexpr int kPad = 8;                // 16 bytes of padding per shared-memory row
static_assert(kRowPad % kBlockQIter == 0 && kRowPad % kBlockQ == 0);

/// Kernel parameters (POD). Row strides: q / o / dout / dq rows are heads * hd elements, k / v / dk / dv kvHeads * hd.
struct BwdKernelParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;  // [heads, sq]
  void* dq;
  void* dk;
  void* dv;
  float* rowLse2;  // workspace [heads, sqPad]: lse * log2(e), +inf for rows that see no key and padded rows
  float* rowDot;   // workspace [heads, sqPad]: D = rowsum(dout * o), 0 for padded rows
  float* dqAccum;  // atomic mode: workspace [sq, heads, hd] fp32 (zeroed before the dk/dv kernel), else null
  int64_t qStart;
  int64_t kStart;
  int32_t sq;
  int32_t sk;
  int32_t sqPad;
  int32_t heads;
  int32_t kvHeads;
  int32_t group;  // heads / kvHeads
  float scale;
  float scaleLog2;  // scale * log2(e)
  int32_t causal;
};

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; srcBytes 0 fills the 16 bytes with zeros (rows past the end).
__device__ __forceinline__ void cpAsync16(void* dst, const void* src, uint32_t srcBytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smemAddr(dst)), "l"(src), "r"(srcBytes)
               : "memory");
}
__device__ __forceinline__ void cpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm4T(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D[16 x 8] += A[16 x 16] B[16 x 8], fp32 accumulators. Fragments (g = lane / 4, c = lane % 4): a = {(g, 2c..), (g + 8,
// 2c..), (g, 2c + 8..), (g + 8, 2c + 8..)}, b = {(k 2c.., n g), (k 2c + 8.., n g)}, d = {(g, 2c), (g, 2c + 1),
// (g + 8, 2c), (g + 8, 2c + 1)}.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one 32-bit pair of T, the first in the low half (the lower column of a fragment).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// Shared-memory tiles: [rows][HD + kPad] elements of 16 bits. ldmatrix addresses for the three operand shapes.
// ---------------------------------------------------------------------------------------------------------------
// A fragment of the 16 x 16 block at (r0, c0) of a [m][k] tile (m rows, k contiguous).
__device__ __forceinline__ uint32_t addrA(uint32_t base, int stride, int r0, int c0, int lane) {
  const int mi = lane / 8;
  const int r = r0 + lane % 8 + (mi & 1) * 8, c = c0 + (mi / 2) * 8;
  return base + static_cast<uint32_t>(r * stride + c) * 2;
}
// B fragments of two n-tiles (n0 .. n0 + 15) at k-step k0 of a [n][k] tile (n rows, k contiguous), non-transposed
// ldmatrix: r[0], r[1] = n-tile 0's b0, b1; r[2], r[3] = n-tile 1's.
__device__ __forceinline__ uint32_t addrBnk(uint32_t base, int stride, int n0, int k0, int lane) {
  const int mi = lane / 8;
  const int r = n0 + lane % 8 + (mi / 2) * 8, c = k0 + (mi & 1) * 8;
  return base + static_cast<uint32_t>(r * stride + c) * 2;
}
// B fragments of two n-tiles (n0 .. n0 + 15) at k-step k0 of a [k][n] tile (k rows, n contiguous), transposed ldmatrix:
// same register order as addrBnk.
__device__ __forceinline__ uint32_t addrBkn(uint32_t base, int stride, int k0, int n0, int lane) {
  const int mi = lane / 8;
  const int r = k0 + lane % 8 + (mi & 1) * 8, c = n0 + (mi / 2) * 8;
  return base + static_cast<uint32_t>(r * stride + c) * 2;
}
// A fragment of the 16 x 16 block (m0, k0) of a [k][m] tile (k rows, m contiguous), transposed ldmatrix.
__device__ __forceinline__ uint32_t addrAkm(uint32_t base, int stride, int k0, int m0, int lane) {
  const int mi = lane / 8;
  const int r = k0 + lane % 8 + (mi / 2) * 8, c = m0 + (mi & 1) * 8;
  return base + static_cast<uint32_t>(r * stride + c) * 2;
}

// acc[NT][4] (n-tiles of 8 columns) += A(16 x K, from `aAddr(kk)`) times B (K x 8 NT, two n-tiles per ldmatrix from
// `bAddr(kk, pair)`), K = 16 KSTEPS.
template <class T, int NT, int KSTEPS, bool BTrans, class AAddr, class BAddr>
__device__ __forceinline__ void mmaSmem(float (&acc)[NT][4], AAddr aAddr, bool aTrans, BAddr bAddr) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    uint32_t a[4];
    if (aTrans) {
      ldsm4T(a, aAddr(kk));
    } else {
      ldsm4(a, aAddr(kk));
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      if constexpr (BTrans) {
        ldsm4T(b, bAddr(kk, np));
      } else {
        ldsm4(b, bAddr(kk, np));
      }
      mma16816<T>(acc[2 * np], a, b[0], b[1]);
      mma16816<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[NT][4] += A (registers: a[KSTEPS][4]) times B (K x 8 NT from `bAddr(kk, pair)`, transposed ldmatrix).
template <class T, int NT, int KSTEPS, class BAddr>
__device__ __forceinline__ void mmaRegA(float (&acc)[NT][4], const uint32_t (&a)[KSTEPS][4], BAddr bAddr) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldsm4T(b, bAddr(kk, np));
      mma16816<T>(acc[2 * np], a[kk], b[0], b[1]);
      mma16816<T>(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

// Accumulator n-tiles 2 kk and 2 kk + 1 of a 16 x (8 NT) fp32 block are the A fragment of k-step kk once packed.
template <class T, int NT>
__device__ __forceinline__ void accToA(uint32_t (&a)[NT / 2][4], const float (&acc)[NT][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    a[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
    a[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
    a[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  }
}

// Rows [row0, row0 + ROWS) of head `head` of a [rows, heads, HD] tensor into a [ROWS][HD + kPad] tile; rows at or past
// `rows` read as zeros. Every thread of the CTA takes part; the caller commits the group.
template <int HD, int ROWS>
__device__ __forceinline__ void loadTile(uint16_t* tile, const void* src, int64_t row0, int32_t rows, int32_t heads,
                                         int32_t head, int tid) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  const uint16_t* base = static_cast<const uint16_t*>(src);
#pragma unroll
  for (int i = tid; i < ROWS * kChunks; i += kThreads) {
    const int r = i / kChunks, ch = i % kChunks;
    const int64_t row = row0 + r;
    const bool valid = row < rows;
    const uint16_t* g = base + ((valid ? row : 0) * heads + head) * HD + ch * 8;
    cpAsync16(tile + r * (HD + kPad) + ch * 8, g, valid ? 16u : 0u);
  }
}

// `n` floats (n % 4 == 0, 16-byte aligned on both sides) into shared memory.
__device__ __forceinline__ void loadFloats(float* dst, const float* src, int n, int tid) {
  for (int i = tid; i < n / 4; i += kThreads) cpAsync16(dst + 4 * i, src + 4 * i, 16u);
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 1: D and lse in log2 units per (head, row). One warp per (row, head); rows up to sqPad.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int HD>
__device__ __forceinline__ void prepareRow(const BwdKernelParams& p, int32_t row, int32_t head, int lane) {
  float dot = 0.0f;
  if (row < p.sq) {
    const int64_t off = (static_cast<int64_t>(row) * p.heads + head) * HD;
    const T* o = static_cast<const T*>(p.o) + off;
    const T* d = static_cast<const T*>(p.dout) + off;
#pragma unroll
    for (int i = lane; i < HD; i += 32) dot += static_cast<float>(o[i]) * static_cast<float>(d[i]);
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (lane == 0) {
    const int64_t w = static_cast<int64_t>(head) * p.sqPad + row;
    float lse2 = INFINITY;  // padded rows and rows that see no key: P = exp2(x - inf) = 0
    if (row < p.sq) {
      const float l = p.lse[static_cast<int64_t>(head) * p.sq + row];
      if (l != -INFINITY) lse2 = l * 1.4426950408889634f;
    }
    p.rowLse2[w] = lse2;
    p.rowDot[w] = row < p.sq ? dot : 0.0f;
  }
}

// Causal / length mask of one element: key row kr of the KV tensor against query row qr.
__device__ __forceinline__ bool visible(const BwdKernelParams& p, int32_t qr, int32_t kr) {
  return kr < p.sk && (!p.causal || p.kStart + kr <= p.qStart + qr);
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 2: dK, dV (and atomic dQ) for keys [kvBlock * kBlockKv, +kBlockKv) of KV head kvHead.
// ---------------------------------------------------------------------------------------------------------------
template <int HD, bool AtomicDq>
struct KvSmem {
  static constexpr int kS = HD + kPad;
  uint16_t k[kBlockKv * kS];
  uint16_t v[kBlockKv * kS];
  uint16_t q[2][kBlockQIter * kS];
  uint16_t dout[2][kBlockQIter * kS];
  alignas(16) float lse2[2][kBlockQIter];
  alignas(16) float dot[2][kBlockQIter];
  uint16_t ds[AtomicDq ? kBlockKv * (kBlockQIter + kPad) : 8];  // dS^T [key][query]
};

template <class T, int HD, bool AtomicDq>
__device__ __forceinline__ void runKvBlock(const BwdKernelParams& p, KvSmem<HD, AtomicDq>& s, int32_t kvBlock,
                                           int32_t kvHead) {
  constexpr int kS = HD + kPad;
  constexpr int kSds = kBlockQIter + kPad;
  constexpr int kNtQ = kBlockQIter / 8;  // n-tiles of S^T (queries)
  constexpr int kNtD = HD / 8;           // n-tiles of dK / dV (head dim)
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c = lane % 4;
  const int32_t key0 = kvBlock * kBlockKv;

  // Query blocks that see any of these keys: rows r with qStart + r >= kStart + key0 (causal).
  int32_t firstQBlock = 0;
  const int32_t numQBlocks = (p.sq + kBlockQIter - 1) / kBlockQIter;
  if (p.causal) {
    const int64_t need = p.kStart + key0 - p.qStart;  // first row that sees key0
    firstQBlock = need <= 0 ? 0 : (need >= p.sq ? numQBlocks : static_cast<int32_t>(need / kBlockQIter));
  }
  const int32_t perHead = numQBlocks - firstQBlock;
  const int32_t iters = perHead * p.group;

  float dk[kNtD][4], dv[kNtD][4];
  zero(dk);
  zero(dv);

  const auto loadStep = [&](int32_t it, int buf) {
    const int32_t head = kvHead * p.group + it / perHead;
    const int32_t row0 = (firstQBlock + it % perHead) * kBlockQIter;
    loadTile<HD, kBlockQIter>(s.q[buf], p.q, row0, p.sq, p.heads, head, tid);
    loadTile<HD, kBlockQIter>(s.dout[buf], p.dout, row0, p.sq, p.heads, head, tid);
    const int64_t w = static_cast<int64_t>(head) * p.sqPad + row0;
    loadFloats(s.lse2[buf], p.rowLse2 + w, kBlockQIter, tid);
    loadFloats(s.dot[buf], p.rowDot + w, kBlockQIter, tid);
  };
  if (iters > 0) {
    loadTile<HD, kBlockKv>(s.k, p.k, key0, p.sk, p.kvHeads, kvHead, tid);
    loadTile<HD, kBlockKv>(s.v, p.v, key0, p.sk, p.kvHeads, kvHead, tid);
    loadStep(0, 0);
  }
  cpAsyncCommit();

  const uint32_t kBase = smemAddr(s.k), vBase = smemAddr(s.v);
  const int32_t keyW = warp * 16;  // this warp's keys inside the block
  for (int32_t it = 0; it < iters; ++it) {
    const int buf = it & 1;
    cpAsyncWaitAll();
    __syncthreads();  // step `it` landed for every thread; every warp is done with step it - 1 (its buffers, s.ds)
    if (it + 1 < iters) loadStep(it + 1, buf ^ 1);
    cpAsyncCommit();
    const int32_t head = kvHead * p.group + it / perHead;
    const int32_t row0 = (firstQBlock + it % perHead) * kBlockQIter;
    const uint32_t qBase = smemAddr(s.q[buf]), doBase = smemAddr(s.dout[buf]);

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x 64 queries.
    float st[kNtQ][4], dpt[kNtQ][4];
    zero(st);
    zero(dpt);
    mmaSmem<T, kNtQ, HD / 16, false>(
        st, [&](int kk) { return addrA(kBase, kS, keyW, 16 * kk, lane); }, false,
        [&](int kk, int np) { return addrBnk(qBase, kS, 16 * np, 16 * kk, lane); });
    mmaSmem<T, kNtQ, HD / 16, false>(
        dpt, [&](int kk) { return addrA(vBase, kS, keyW, 16 * kk, lane); }, false,
        [&](int kk, int np) { return addrBnk(doBase, kS, 16 * np, 16 * kk, lane); });

    // P^T and dS^T in place: element (key keyW + g + 8 (e / 2), query 8 j + 2 c + e % 2).
    const bool mask = key0 + kBlockKv > p.sk ||
                      (p.causal && p.kStart + key0 + kBlockKv - 1 > p.qStart + row0);  // CTA-uniform
#pragma unroll
    for (int j = 0; j < kNtQ; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = 8 * j + 2 * c + (e & 1);
        float pv = exp2Approx(st[j][e] * p.scaleLog2 - s.lse2[buf][qc]);
        if (mask && !visible(p, row0 + qc, key0 + keyW + g + 8 * (e >> 1))) pv = 0.0f;
        st[j][e] = pv;
        dpt[j][e] = pv * (dpt[j][e] - s.dot[buf][qc]);
      }
    }
    uint32_t pa[kNtQ / 2][4], dsa[kNtQ / 2][4];
    accToA<T, kNtQ>(pa, st);
    accToA<T, kNtQ>(dsa, dpt);

    // dV += P^T dO, dK += dS^T Q (k = queries, n = head dim).
    mmaRegA<T, kNtD, kNtQ / 2>(dv, pa, [&](int kk, int np) { return addrBkn(doBase, kS, 16 * kk, 16 * np, lane); });
    mmaRegA<T, kNtD, kNtQ / 2>(dk, dsa, [&](int kk, int np) { return addrBkn(qBase, kS, 16 * kk, 16 * np, lane); });

    if constexpr (AtomicDq) {
      // dS^T to shared memory, then dQ[64 x HD] += dS K over the block's keys: warp w takes query rows 16 (w % 4)
      // and head-dim half w / 4.
#pragma unroll
      for (int kk = 0; kk < kNtQ / 2; ++kk) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // a[kk][0..3] = (g, 16kk + 2c), (g + 8, ..), (g, 16kk + 8 + 2c), (g + 8, ..)
          uint32_t* row = reinterpret_cast<uint32_t*>(s.ds + (keyW + g + 8 * h) * kSds);
          row[(16 * kk + 2 * c) / 2] = dsa[kk][h];
          row[(16 * kk + 8 + 2 * c) / 2] = dsa[kk][2 + h];
        }
      }
      __syncthreads();  // dS^T of every warp written
      constexpr int kNtHalf = HD / 16;  // n-tiles per warp: half the head dim
      const int m0 = 16 * (warp % 4), n0 = (warp / 4) * (HD / 2);
      float dq[kNtHalf][4];
      zero(dq);
      const uint32_t dsBase = smemAddr(s.ds);
      mmaSmem<T, kNtHalf, kBlockKv / 16, true>(
          dq, [&](int kk) { return addrAkm(dsBase, kSds, 16 * kk, m0, lane); }, true,
          [&](int kk, int np) { return addrBkn(kBase, kS, 16 * kk, n0 + 16 * np, lane); });
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int32_t row = row0 + m0 + g + 8 * h;
        if (row >= p.sq) continue;
        float* dst = p.dqAccum + (static_cast<int64_t>(row) * p.heads + head) * HD + n0 + 2 * c;
#pragma unroll
        for (int j = 0; j < kNtHalf; ++j) {
          atomicAdd(dst + 8 * j, dq[j][2 * h]);
          atomicAdd(dst + 8 * j + 1, dq[j][2 * h + 1]);
        }
      }
    }
  }

  // dK = scale dS^T Q; rows past sk dropped. Element (key keyW + g + 8 h, dim 8 j + 2 c ..).
  T* const dkOut = static_cast<T*>(p.dk);
  T* const dvOut = static_cast<T*>(p.dv);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t key = key0 + keyW + g + 8 * h;
    if (key >= p.sk) continue;
    const int64_t off = (static_cast<int64_t>(key) * p.kvHeads + kvHead) * HD + 2 * c;
#pragma unroll
    for (int j = 0; j < kNtD; ++j) {
      *reinterpret_cast<uint32_t*>(dkOut + off + 8 * j) = pack2<T>(dk[j][2 * h] * p.scale, dk[j][2 * h + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvOut + off + 8 * j) = pack2<T>(dv[j][2 * h], dv[j][2 * h + 1]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Pass 3 (deterministic dq): dQ for rows [qBlock * kBlockQ, +kBlockQ) of query head `head`, KV blocks in order.
// ---------------------------------------------------------------------------------------------------------------
template <int HD>
struct QSmem {
  static constexpr int kS = HD + kPad;
  uint16_t q[kBlockQ * kS];
  uint16_t dout[kBlockQ * kS];
  uint16_t k[2][kBlockKvIter * kS];
  uint16_t v[2][kBlockKvIter * kS];
};

template <class T, int HD>
__device__ __forceinline__ void runQBlock(const BwdKernelParams& p, QSmem<HD>& s, int32_t qBlock, int32_t head) {
  constexpr int kS = HD + kPad;
  constexpr int kNtK = kBlockKvIter / 8;  // n-tiles of S (keys)
  constexpr int kNtD = HD / 8;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c = lane % 4;
  const int32_t row0 = qBlock * kBlockQ;
  const int32_t kvHead = head / p.group;
  const int32_t rowW = warp * 16;

  // Keys the block's last row sees (causal): rows r of K with kStart + r <= qStart + lastRow.
  int64_t keys = p.sk;
  if (p.causal) {
    const int32_t lastRow = min(row0 + kBlockQ, p.sq) - 1;
    const int64_t upTo = p.qStart + lastRow - p.kStart + 1;
    keys = upTo < 0 ? 0 : (upTo < keys ? upTo : keys);
  }
  const int32_t iters = static_cast<int32_t>((keys + kBlockKvIter - 1) / kBlockKvIter);

  loadTile<HD, kBlockQ>(s.q, p.q, row0, p.sq, p.heads, head, tid);
  loadTile<HD, kBlockQ>(s.dout, p.dout, row0, p.sq, p.heads, head, tid);
  const auto loadStep = [&](int32_t it, int buf) {
    loadTile<HD, kBlockKvIter>(s.k[buf], p.k, it * kBlockKvIter, p.sk, p.kvHeads, kvHead, tid);
    loadTile<HD, kBlockKvIter>(s.v[buf], p.v, it * kBlockKvIter, p.sk, p.kvHeads, kvHead, tid);
  };
  if (iters > 0) loadStep(0, 0);
  cpAsyncCommit();

  // This thread's two rows: rowW + g and rowW + g + 8.
  float lse2[2], dot[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t w = static_cast<int64_t>(head) * p.sqPad + row0 + rowW + g + 8 * h;
    lse2[h] = p.rowLse2[w];
    dot[h] = p.rowDot[w];
  }

  float dq[kNtD][4];
  zero(dq);
  const uint32_t qBase = smemAddr(s.q), doBase = smemAddr(s.dout);
  for (int32_t it = 0; it < iters; ++it) {
    const int buf = it & 1;
    cpAsyncWaitAll();
    __syncthreads();  // step `it` landed for every thread; every warp is done with step it - 1's buffers
    if (it + 1 < iters) loadStep(it + 1, buf ^ 1);
    cpAsyncCommit();
    const int32_t key0 = it * kBlockKvIter;
    const uint32_t kBase = smemAddr(s.k[buf]), vBase = smemAddr(s.v[buf]);

    float sc[kNtK][4], dp[kNtK][4];
    zero(sc);
    zero(dp);
    mmaSmem<T, kNtK, HD / 16, false>(
        sc, [&](int kk) { return addrA(qBase, kS, rowW, 16 * kk, lane); }, false,
        [&](int kk, int np) { return addrBnk(kBase, kS, 16 * np, 16 * kk, lane); });
    mmaSmem<T, kNtK, HD / 16, false>(
        dp, [&](int kk) { return addrA(doBase, kS, rowW, 16 * kk, lane); }, false,
        [&](int kk, int np) { return addrBnk(vBase, kS, 16 * np, 16 * kk, lane); });

    // Element (row rowW + g + 8 (e / 2), key 8 j + 2 c + e % 2).
    const bool mask = key0 + kBlockKvIter > p.sk ||
                      (p.causal && p.kStart + key0 + kBlockKvIter - 1 > p.qStart + row0);  // CTA-uniform
#pragma unroll
    for (int j = 0; j < kNtK; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        float pv = exp2Approx(sc[j][e] * p.scaleLog2 - lse2[h]);
        if (mask && !visible(p, row0 + rowW + g + 8 * h, key0 + 8 * j + 2 * c + (e & 1))) pv = 0.0f;
        dp[j][e] = pv * (dp[j][e] - dot[h]);
      }
    }
    uint32_t dsa[kNtK / 2][4];
    accToA<T, kNtK>(dsa, dp);
    // dQ += dS K (k = keys, n = head dim).
    mmaRegA<T, kNtD, kNtK / 2>(dq, dsa, [&](int kk, int np) { return addrBkn(kBase, kS, 16 * kk, 16 * np, lane); });
  }

  T* const out = static_cast<T*>(p.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t row = row0 + rowW + g + 8 * h;
    if (row >= p.sq) continue;
    const int64_t off = (static_cast<int64_t>(row) * p.heads + head) * HD + 2 * c;
#pragma unroll
    for (int j = 0; j < kNtD; ++j) {
      *reinterpret_cast<uint32_t*>(out + off + 8 * j) = pack2<T>(dq[j][2 * h] * p.scale, dq[j][2 * h + 1] * p.scale);
    }
  }
}

// Atomic dq mode's last pass: dq = scale * dqAccum, rounded to T. Elements [i0, n) with stride.
template <class T>
__device__ __forceinline__ void roundDq(const BwdKernelParams& p, int64_t n, int64_t i0, int64_t stride) {
  T* const out = static_cast<T*>(p.dq);
  for (int64_t i = i0; i < n; i += stride) out[i] = static_cast<T>(p.dqAccum[i] * p.scale);
}

}  // namespace tandem::kernels::attn_bwd
