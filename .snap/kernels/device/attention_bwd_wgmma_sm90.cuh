// Hopper (sm_90a) attention backward, dk / dv pass (and dq by fp32 atomics in AttentionBwdDq::kAtomic mode), on wgmma
// and TMA with warp specialisation (FlashAttention-3's backward design). The row preparation and the atomic mode's
// rounding stay those of device/attention_bwd_sm90.cuh; this header replaces its runKvBlock, and
// device/attention_bwd_wgmma_dq_sm90.cuh (built on the pieces here) its runQBlock. No __global__ here: attention_bwd.cu
// wires it into a kernel.
//
// One CTA per (KV block of kBlockKv = 128 keys, KV head), 3 warpgroups:
//   warpgroup 0: producer. One thread loads K and V of the block once (TMA), then per step the Q and dO blocks of
//     BQ query rows (TMA, 128-byte swizzled 64-column halves) and their lse (log2 units) and D rows (bulk copies) into
//     a kStages-deep ring. Steps walk every query head of the KV head's group and, per head, every query block that
//     sees the keys (causal: the blocks wholly before the keys are skipped).
//   warpgroups 1 and 2: consumers; consumer w owns keys [64 w, 64 w + 64) of the block (wgmma M = 64). Per step:
//     S^T  = K_w Q^T      wgmma m64nBQk16, A = K and B = Q from shared memory (both K-major)
//     dP^T = V_w dO^T     the same with V and dO
//     P^T  = exp2(S^T scale log2e - lse2), dS^T = P^T (dP^T - D)   in registers (masked where the block needs it)
//     dV  += P^T dO       wgmma m64nHDk16, A = P^T from registers (the accumulator layout of S^T is the A-fragment
//     dK  += dS^T Q       layout once packed to 16 bits), B = dO / Q read N-major from the same tiles (no copy)
//   and, in atomic dq mode, dS^T goes to shared memory (128-byte swizzle, as wgmma reads an MN-major operand) and
//     dQ = dS K           wgmma m64n64k16, A = dS (MN-major: the stored dS^T), B = K (MN-major), 128 keys of k
//   is added to the fp32 workspace with vector atomics (float2): head_dim 128: all 128 keys, consumer w takes
//   head-dim half w (a barrier of both consumers first); head_dim 64: consumer w takes its own 64 keys and the whole
//   head dim (a barrier of its own warpgroup only; twice the atomics).
// dK and dV stay in registers for the whole CTA: HD / 2 fp32 each per thread, plus BQ / 2 each for S^T and dP^T,
// which is what sets BQ (query rows per step): 64 at head_dim 128 (64 + 64 + 32 + 32); at head_dim 64, 128 without
// dq (32 + 32 + 64 + 64, dP^T issued after S^T's registers are free) and 64 with atomic dq (ptxas spilled at 128).
// ptxas -v: no spills in any of the 8 instantiations (168 registers at launch, setmaxnreg 40 / 232).
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/attention_bwd_sm90.cuh"  // BwdKernelParams, visible, kRowPad
#include "device/attention_sm90.cuh"      // WgmmaRS, makeSmemDescNMajor, issuePV, packP, exp2Approx
#include "device/gemm_layouts_sm90.cuh"   // Wgmma (SS, transpose bits)
#include "device/gemm_sm90.cuh"           // mbarrier, TMA, bulk copies, wgmma fence / commit / wait, setmaxnreg

namespace tandem::kernels::attn_bwd::wg {

// ---------------------------------------------------------------------------------------------------------------
// Geometry (shared with the host launcher in attention_bwd.cu).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kBlockKv = 128;  // keys per CTA: 64 per consumer warpgroup
inline constexpr int kConsumerWarpgroups = 2;
inline constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
inline constexpr int kStages = 2;
inline constexpr int kSwizzleCols = 64;  // 64 x 16-bit = one 128-byte swizzle row; head_dim 128 comes in halves
// setmaxnreg pool: 168 registers per thread under __launch_bounds__(384, 1); 40 + 2 x 232 = 504 = 3 x 168 (the
// forward core's split, attention_sm90.cuh).
inline constexpr uint32_t kProducerRegs = 40;
inline constexpr uint32_t kConsumerRegs = 232;
static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <= 168 * 3, "setmaxnreg pool");

// Query rows per step (see the header comment): 128 only at head_dim 64 without dq, where the registers allow it.
template <int HD, bool AtomicDq>
inline constexpr int kBlockQ = HD == 64 && !AtomicDq ? 128 : 64;
static_assert(kRowPad % 128 == 0, "lse / D rows are padded to whole steps");

// Named barriers (bar.sync ids); 0 is __syncthreads. kConsumer0 / 1: one consumer warpgroup; kConsumers: both.
enum class Barrier : uint32_t { kCta = 0, kConsumer0 = 1, kConsumer1 = 2, kConsumers = 3 };
__device__ __forceinline__ void barSync(Barrier id, uint32_t threads) {
  gemm::namedBarSyncId(static_cast<uint32_t>(id), threads);
}

enum class Role : uint8_t { kProducer = 0, kConsumer = 1 };
__host__ __device__ constexpr Role roleOf(int wg) { return wg == 0 ? Role::kProducer : Role::kConsumer; }

/// Kernel parameters: the mma.sync core's plus the four tensor maps (row-major [rows, heads * hd] of 16-bit
/// elements, 128-byte swizzle, box {64, rows}: Q and dO boxes of BQ rows, K and V of kBlockKv rows).
struct WgKernelParams {
  CUtensorMap tmQ;
  CUtensorMap tmDout;
  CUtensorMap tmK;
  CUtensorMap tmV;
  BwdKernelParams b;
};
static_assert(sizeof(WgKernelParams) <= 4096, "kernel parameter space");

// ---------------------------------------------------------------------------------------------------------------
// Shared memory. Tiles in 64-column halves ([rows][128 bytes], 128B-swizzled as TMA writes them), each on 1024 bytes.
// ---------------------------------------------------------------------------------------------------------------
template <int HD, bool AtomicDq>
struct SharedStorage {
  static constexpr int BQ = kBlockQ<HD, AtomicDq>;
  alignas(1024) uint16_t k[kBlockKv * HD];
  alignas(1024) uint16_t v[kBlockKv * HD];
  alignas(1024) uint16_t q[kStages][BQ * HD];
  alignas(1024) uint16_t dout[kStages][BQ * HD];
  // dS^T [keys][queries] in 64-query halves like the tiles; two buffers (a step's writes may not wait for the other
  // warpgroup's dq product of the step before).
  alignas(1024) uint16_t ds[AtomicDq ? 2 : 1][AtomicDq ? kBlockKv * BQ : 8];
  alignas(16) float lse2[kStages][BQ];
  alignas(16) float dot[kStages][BQ];
  alignas(8) uint64_t fullKv;  // K and V landed (one phase per CTA)
  uint64_t full[kStages];      // Q, dO, lse2, D of the stage landed (the producer's expect_tx)
  uint64_t empty[kStages];     // both consumer warpgroups are done reading the stage
};
template <int HD, bool AtomicDq>
inline constexpr size_t kSmemBytes = sizeof(SharedStorage<HD, AtomicDq>) + 1024;  // + slack to align the base
static_assert(kSmemBytes<128, true> <= 227 * 1024 && kSmemBytes<64, true> <= 227 * 1024, "opt-in shared memory");

// ---------------------------------------------------------------------------------------------------------------
// The step walk, identical for producer and consumers: step `it` is query block firstQBlock + it % perHead of query
// head kvHead * group + it / perHead.
// ---------------------------------------------------------------------------------------------------------------
struct Walk {
  int32_t firstQBlock, perHead, steps;
};
template <int BQ>
__device__ __forceinline__ Walk walkOf(const BwdKernelParams& p, int32_t key0) {
  Walk w{0, 0, 0};
  const int32_t numQBlocks = (p.sq + BQ - 1) / BQ;
  if (p.causal) {
    const int64_t need = p.kStart + key0 - p.qStart;  // first query row that sees key0
    w.firstQBlock = need <= 0 ? 0 : (need >= p.sq ? numQBlocks : static_cast<int32_t>(need / BQ));
  }
  w.perHead = numQBlocks - w.firstQBlock;
  w.steps = w.perHead * p.group;
  return w;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread.
// ---------------------------------------------------------------------------------------------------------------
template <int HD, bool AtomicDq>
__device__ __forceinline__ void runProducer(const WgKernelParams& p, SharedStorage<HD, AtomicDq>& s, int32_t kvBlock,
                                            int32_t kvHead) {
  constexpr int BQ = kBlockQ<HD, AtomicDq>;
  const BwdKernelParams& b = p.b;
  const int32_t key0 = kvBlock * kBlockKv;
  const Walk w = walkOf<BQ>(b, key0);
  if (w.steps == 0) return;  // the consumers store zeros without waiting on anything
  gemm::mbarArriveExpectTx(&s.fullKv, 2 * kBlockKv * HD * 2);  // full boxes: rows past sk count too (zero-filled)
#pragma unroll
  for (int h = 0; h < HD / kSwizzleCols; ++h) {
    const int32_t col = kvHead * HD + h * kSwizzleCols;
    gemm::tmaLoad2d(&p.tmK, s.k + h * kBlockKv * kSwizzleCols, &s.fullKv, col, key0);
    gemm::tmaLoad2d(&p.tmV, s.v + h * kBlockKv * kSwizzleCols, &s.fullKv, col, key0);
  }
  gemm::PipeState<kStages> ps;
  for (int32_t it = 0; it < w.steps; ++it) {
    const int32_t head = kvHead * b.group + it / w.perHead;
    const int32_t row0 = (w.firstQBlock + it % w.perHead) * BQ;
    // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete. Pairs with the
    // consumers' release (mbarArrive on empty after their last read of the stage).
    gemm::mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
    gemm::mbarArriveExpectTx(&s.full[ps.stage], 2 * BQ * HD * 2 + 2 * BQ * 4);
#pragma unroll
    for (int h = 0; h < HD / kSwizzleCols; ++h) {
      const int32_t col = head * HD + h * kSwizzleCols;
      gemm::tmaLoad2d(&p.tmQ, s.q[ps.stage] + h * BQ * kSwizzleCols, &s.full[ps.stage], col, row0);
      gemm::tmaLoad2d(&p.tmDout, s.dout[ps.stage] + h * BQ * kSwizzleCols, &s.full[ps.stage], col, row0);
    }
    // Rows are padded to kRowPad (a multiple of BQ) in the workspace: whole blocks, 16-byte aligned.
    const int64_t wr = static_cast<int64_t>(head) * b.sqPad + row0;
    gemm::bulkLoad(s.lse2[ps.stage], b.rowLse2 + wr, BQ * 4, &s.full[ps.stage]);
    gemm::bulkLoad(s.dot[ps.stage], b.rowDot + wr, BQ * 4, &s.full[ps.stage]);
    ps.advance();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer pieces. Thread t of a warpgroup holds, of every 64 x N accumulator, rows r = 16 (t / 32) + (t % 32) / 4
// and r + 8, columns 8 j + 2 (t % 4) + {0, 1}: acc[4 j + {0, 1}] is row r, acc[4 j + {2, 3}] row r + 8.
// ---------------------------------------------------------------------------------------------------------------
// D[64 x BQ] = A[64 x HD] B[BQ x HD]^T, both K-major 64-column halves: A rows ARows per half (the warpgroup's 64
// rows start at aAddr), B rows BQ per half. One commit group. The dk/dv pass passes K or V as A (kBlockKv rows), the
// dq pass Q or dO (its kDqBlockQ rows) and B = K or V.
template <class T, int HD, int BQ, int ARows = kBlockKv>
__device__ __forceinline__ void issueSS(float (&acc)[BQ / 2], uint32_t aAddr, uint32_t bAddr) {
  gemm::wgmmaFence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    // k-step kk: half kk / 4, 32 bytes further into the 128-byte row per step inside a half.
    const uint32_t off = static_cast<uint32_t>(kk % 4) * 32;
    const uint64_t descA = gemm::makeSmemDesc(aAddr + (kk / 4) * (ARows * 128) + off);
    const uint64_t descB = gemm::makeSmemDesc(bAddr + (kk / 4) * (BQ * 128) + off);
    gemm_layouts::Wgmma<T, BQ>::template run<0, 0>(acc, descA, descB, kk > 0 ? 1u : 0u);
  }
  gemm::wgmmaCommit();
}

// Per-thread mask of one step: of key rows r and r + 8 (h = 0, 1), queries [0, lim[h]) of the step are masked: all
// of them for keys past sk, and (causal) those before the first query that sees the key. Int32 compares in the
// element loop instead of 64-bit positions (registers).
template <int BQ>
__device__ __forceinline__ void maskLimits(const BwdKernelParams& p, int32_t row0, int32_t key0w, int t,
                                           int32_t (&lim)[2]) {
  const int32_t r = (t / 32) * 16 + (t % 32) / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t key = key0w + r + 8 * h;
    lim[h] = 0;
    if (key >= p.sk) {
      lim[h] = BQ;
    } else if (p.causal) {
      const int64_t first = p.kStart + key - p.qStart - row0;  // step column of the first query that sees the key
      lim[h] = first <= 0 ? 0 : (first >= BQ ? BQ : static_cast<int32_t>(first));
    }
  }
}

// P^T of one step in place of S^T (keys are rows, the step's queries columns).
template <int BQ>
__device__ __forceinline__ void probs(float (&st)[BQ / 2], const float* lse2, float scaleLog2, bool mask,
                                      const int32_t (&lim)[2], int t) {
  const int c2 = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < BQ / 8; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse2 + 8 * j + c2);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float pv = exp2Approx(fmaf(st[4 * j + e], scaleLog2, -((e & 1) ? l.y : l.x)));
      if (mask && 8 * j + c2 + (e & 1) < lim[e >> 1]) pv = 0.0f;
      st[4 * j + e] = pv;
    }
  }
}

// dS^T = P^T (dP^T - D) in place of dP^T; pairOf(i) gives P^T elements 2 i and 2 i + 1 (fp32, or unpacked from
// the 16-bit A fragments).
template <int BQ, class PairOf>
__device__ __forceinline__ void gradS(float (&dpt)[BQ / 2], PairOf pairOf, const float* dot, int t) {
  const int c2 = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < BQ / 8; ++j) {
    const float2 d = *reinterpret_cast<const float2*>(dot + 8 * j + c2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 pv = pairOf(2 * j + h);
      dpt[4 * j + 2 * h] = pv.x * (dpt[4 * j + 2 * h] - d.x);
      dpt[4 * j + 2 * h + 1] = pv.y * (dpt[4 * j + 2 * h + 1] - d.y);
    }
  }
}

template <class T>
__device__ __forceinline__ float2 unpackPair(uint32_t v);
template <>
__device__ __forceinline__ float2 unpackPair<__nv_bfloat16>(uint32_t v) {
  // bf16 is the upper half of an fp32: exact by shifts (the library conversion went through a stack copy here).
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}
template <>
__device__ __forceinline__ float2 unpackPair<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// dS^T (packed A fragments, this warpgroup's 64 keys starting at row keyW) into the [keys][queries] smem tile in
// 64-query halves of kBlockKv rows x 128 bytes, 128-byte swizzle (16-byte unit u of row r sits at u ^ (r % 8)).
template <int BQ>
__device__ __forceinline__ void storeDsT(uint32_t base, const uint32_t (&dsf)[BQ / 4], int32_t keyW, int t) {
  const int lane = t % 32;
  const uint32_t c4 = static_cast<uint32_t>(lane & 3) * 4;
#pragma unroll
  for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = static_cast<uint32_t>(keyW + (t / 32) * 16 + lane / 4 + 8 * h);
      const uint32_t unit = static_cast<uint32_t>(j % 8) ^ (row & 7);
      const uint32_t addr = base + static_cast<uint32_t>(j / 8) * (kBlockKv * 128) + row * 128 + (unit << 4) + c4;
      gemm::stShared32(addr, dsf[2 * j + h]);  // packP: dsf[2 j] is row r, dsf[2 j + 1] row r + 8
    }
  }
}

// dQ part of this warpgroup = dS[64 queries x KEYS] K[KEYS x 64 dims], both MN-major in shared memory (dS as the
// stored dS^T [keys][queries]): dsAddr and kAddr point at the first key's row, kAddr inside the 64-column half of K
// that holds the dims. One commit group.
template <class T, int KEYS>
__device__ __forceinline__ void issueDq(float (&acc)[32], uint32_t dsAddr, uint32_t kAddr) {
  gemm::wgmmaFence();
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk) {
    // Keys 16 kk .. 16 kk + 15: two 8-row swizzle groups, 2048 bytes on. One 64-wide chunk along M and along N.
    const uint32_t off = static_cast<uint32_t>(kk) * 2048;
    const uint64_t descA = attn::makeSmemDescNMajor(dsAddr + off, kBlockKv * 128);
    const uint64_t descB = attn::makeSmemDescNMajor(kAddr + off, kBlockKv * 128);
    gemm_layouts::Wgmma<T, 64>::template run<1, 1>(acc, descA, descB, kk > 0 ? 1u : 0u);
  }
  gemm::wgmmaCommit();
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): keys [64 wg, 64 wg + 64) of the block; t = thread index within the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int HD, bool AtomicDq>
__device__ __forceinline__ void runConsumer(const WgKernelParams& params, SharedStorage<HD, AtomicDq>& s,
                                            int32_t kvBlock, int32_t kvHead, int wg, int t) {
  constexpr int BQ = kBlockQ<HD, AtomicDq>;
  // At BQ = 128 (head_dim 64) S^T and dP^T (64 fp32 each) cannot be live together next to dK and dV without spills:
  // dS^T is then computed from the 16-bit P^T (the A fragments dV's product takes), after S^T's registers are free.
  constexpr bool kPFromFragments = BQ == 128;
  const BwdKernelParams& p = params.b;
  const int lane = t % 32;
  const int32_t key0 = kvBlock * kBlockKv;
  const int32_t keyW = wg * 64;  // this warpgroup's keys inside the block
  const Walk w = walkOf<BQ>(p, key0);

  float dk[HD / 2], dv[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dk[i] = dv[i] = 0.0f;

  if (w.steps > 0) {
    const uint32_t kAddr = gemm::smemAddr(s.k), vAddr = gemm::smemAddr(s.v);
    gemm::mbarWait(&s.fullKv, 0);  // acquire: K and V landed
    gemm::PipeState<kStages> ps;
    for (int32_t it = 0; it < w.steps; ++it) {
      const int32_t row0 = (w.firstQBlock + it % w.perHead) * BQ;
      const uint32_t qAddr = gemm::smemAddr(s.q[ps.stage]), doAddr = gemm::smemAddr(s.dout[ps.stage]);
      gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: Q, dO, lse2, D of the step landed

      // Masking: keys past sk, or (causal) a block that reaches past the step's first query. Warpgroup-uniform.
      const bool mask = key0 + kBlockKv > p.sk || (p.causal && p.kStart + key0 + kBlockKv - 1 > p.qStart + row0);
      int32_t lim[2] = {0, 0};
      if (mask) maskLimits<BQ>(p, row0, key0 + keyW, t, lim);
      const float* const lse2 = s.lse2[ps.stage];
      const float* const dot = s.dot[ps.stage];
      float st[BQ / 2], dpt[BQ / 2];
      uint32_t pf[BQ / 4], dsf[BQ / 4];
      if constexpr (kPFromFragments) {
        // S^T, P^T, its fragments; only then dP^T (S^T's registers are free), and dS^T from the 16-bit P^T.
        issueSS<T, HD, BQ>(st, kAddr + keyW * 128, qAddr);
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(st);
        probs<BQ>(st, lse2, p.scaleLog2, mask, lim, t);
        attn::packP<T, BQ>(pf, st);
        issueSS<T, HD, BQ>(dpt, vAddr + keyW * 128, doAddr);
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(dpt);
        gradS<BQ>(dpt, [&](int i) { return unpackPair<T>(pf[i]); }, dot, t);
      } else {
        // Both products in flight; P^T's exp2 runs while dP^T is computed.
        issueSS<T, HD, BQ>(st, kAddr + keyW * 128, qAddr);
        issueSS<T, HD, BQ>(dpt, vAddr + keyW * 128, doAddr);
        gemm::wgmmaWait<1>();  // S^T done (groups complete in order)
        gemm::fenceAccumulators(st);
        probs<BQ>(st, lse2, p.scaleLog2, mask, lim, t);
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(dpt);
        gradS<BQ>(dpt, [&](int i) { return make_float2(st[2 * i], st[2 * i + 1]); }, dot, t);
        attn::packP<T, BQ>(pf, st);
      }
      attn::packP<T, BQ>(dsf, dpt);
      if constexpr (AtomicDq) {
        // dS^T to shared memory for the dq product, before dK's wgmma reads dsf (no register access in its window).
        storeDsT<BQ>(gemm::smemAddr(s.ds[it & 1]), dsf, keyW, t);
        gemm::fenceProxyAsyncShared();  // the st.shared above -> visible to wgmma (async proxy)
      }

      // dV += P^T dO, dK += dS^T Q (k = the step's queries, N = head dim, B read N-major from the tiles).
      attn::issuePV<T, HD, BQ>(dv, pf, doAddr);
      attn::issuePV<T, HD, BQ>(dk, dsf, qAddr);

      // dV and dK done: their A fragments are free, the stage's tiles read.
      gemm::wgmmaWait<0>();
      gemm::fenceAccumulators(dv);
      gemm::fenceAccumulators(dk);
      attn::fenceRegs(pf);
      attn::fenceRegs(dsf);
      // release: every read of the stage (lse2 / D above, Q and dO by the completed wgmma); pairs with the
      // producer's empty wait.
      if (t == 0) gemm::mbarArrive(&s.empty[ps.stage]);
      if constexpr (AtomicDq) {
        const uint32_t dsAddr = gemm::smemAddr(s.ds[it & 1]);
        float dq[32];
        // Issued after dV / dK completed, so that their A fragments (BQ / 2 registers) are not live next to dQ's.
        if constexpr (HD == 128) {
          // Both warpgroups' dS^T written; also, the other warpgroup finished step it - 1, so its dq product of step
          // it - 2, which read this buffer, is done. Then all 128 keys, head-dim half wg.
          barSync(Barrier::kConsumers, 2 * 128);
          issueDq<T, kBlockKv>(dq, dsAddr, kAddr + wg * (kBlockKv * 128));
        } else {
          // head_dim 64: this warpgroup's own 64 keys (its dS^T rows, written by its 4 warps), the whole head dim;
          // the two warpgroups' partial dQ are both added. (Splitting the 64 dims instead would need 32-wide MN-major
          // operands inside a 128-byte swizzle atom.)
          barSync(wg == 0 ? Barrier::kConsumer0 : Barrier::kConsumer1, 128);
          issueDq<T, 64>(dq, dsAddr + keyW * 128, kAddr + keyW * 128);
        }
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(dq);
        const int32_t head = kvHead * p.group + it / w.perHead;
        const int32_t r = (t / 32) * 16 + lane / 4;
        const int32_t col = (HD == 128 ? wg * 64 : 0) + 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int32_t row = row0 + r + 8 * h;
          if (row >= p.sq) continue;
          float* const dst = p.dqAccum + (static_cast<int64_t>(row) * p.heads + head) * HD + col;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            atomicAdd(reinterpret_cast<float2*>(dst + 8 * j), make_float2(dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]));
          }
        }
      }
      ps.advance();
    }
  }

  // dK = scale dS^T Q; keys past sk dropped. Element (key keyW + r + 8 h, dim 8 j + 2 (t % 4) ..).
  T* const dkOut = static_cast<T*>(p.dk);
  T* const dvOut = static_cast<T*>(p.dv);
  const int32_t r = (t / 32) * 16 + lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t key = key0 + keyW + r + 8 * h;
    if (key >= p.sk) continue;
    const int64_t off = (static_cast<int64_t>(key) * p.kvHeads + kvHead) * HD + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      *reinterpret_cast<uint32_t*>(dkOut + off + 8 * j) =
          gemm::packPair<T>(dk[4 * j + 2 * h] * p.scale, dk[4 * j + 2 * h + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvOut + off + 8 * j) = gemm::packPair<T>(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), kThreads threads and
// kSmemBytes<HD, AtomicDq> of dynamic shared memory.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int HD, bool AtomicDq>
__device__ __forceinline__ void runKvCta(const WgKernelParams& p, uint8_t* smemRaw, int32_t kvBlock, int32_t kvHead) {
  static_assert(HD == 64 || HD == 128, "head dim");
  auto& s = *reinterpret_cast<SharedStorage<HD, AtomicDq>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                             ~static_cast<uintptr_t>(1023));
  const int wgIdx = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads
    gemm::mbarInit(&s.fullKv, 1);
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      gemm::mbarInit(&s.full[i], 1);
      gemm::mbarInit(&s.empty[i], kConsumerWarpgroups);
    }
    gemm::fenceBarrierInit();
    gemm::prefetchTensorMap(&p.tmQ);
    gemm::prefetchTensorMap(&p.tmDout);
    gemm::prefetchTensorMap(&p.tmK);
    gemm::prefetchTensorMap(&p.tmV);
  }
  __syncthreads();  // barriers initialised before any thread uses them
  switch (roleOf(wgIdx)) {
    case Role::kProducer:
      gemm::setMaxNRegDec<kProducerRegs>();
      if (t == 0) runProducer<HD, AtomicDq>(p, s, kvBlock, kvHead);
      break;
    case Role::kConsumer:
      gemm::setMaxNRegInc<kConsumerRegs>();
      runConsumer<T, HD, AtomicDq>(p, s, kvBlock, kvHead, wgIdx - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::attn_bwd::wg
