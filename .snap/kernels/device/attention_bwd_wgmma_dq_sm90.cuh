// Hopper (sm_90a) attention backward, deterministic dq pass (AttentionBwdDq::kDeterministic) on wgmma and TMA with
// warp specialisation: the dk/dv pass's building blocks (device/attention_bwd_wgmma_sm90.cuh) turned around so that
// queries are the rows. No atomics: each CTA owns its query rows and sums over the KV blocks in a fixed order, so dq is
// bitwise repeatable. No __global__ here: attention_bwd.cu wires it into a kernel.
//
// One CTA per (query block of kDqBlockQ = 128 rows, query head), 3 warpgroups:
//   warpgroup 0: producer. One thread loads Q and dO of the block once (TMA, 128-byte swizzled 64-column halves), then
//     per step K and V of BK keys of the query head's KV head into a kDqStages-deep ring. Steps walk the KV blocks from
//     key 0 up to the last key the block's last row sees (causal: the blocks wholly in the future are skipped).
//   warpgroups 1 and 2: consumers; consumer w owns query rows [64 w, 64 w + 64) of the block (wgmma M = 64) and reads
//     its rows' lse (log2 units) and D once from the workspace. Per step:
//     S  = Q_w K^T        wgmma m64nBKk16, A = Q and B = K from shared memory (both K-major)
//     dP = dO_w V^T       the same with dO and V
//     P = exp2(S scale log2e - lse2), dS = P (dP - D)   in registers (masked where the block needs it)
//     dQ += dS K          wgmma m64nHDk16, A = dS from registers (the accumulator layout of S is the A-fragment
//                         layout once packed to 16 bits), B = K read N-major from the same tile (no copy)
//   dQ stays in registers for the whole CTA and is written once, scaled, as 16-bit values.
// Registers per consumer thread: HD / 2 for dQ, BK / 2 each for S and dP and BK / 4 for the packed dS of the step
// before (its dQ product is waited for only in the next step, after that step's S and dP are issued), which is what
// sets BK (keys per step, kDqBlockKv): 64 at head_dim 128 (64 + 32 + 32 + 16), 128 at head_dim 64 (32 + 64 + 64 + 32).
// Both products in flight, P's exp2 runs while dP is computed; the two consumer warpgroups interleave, so one's exp2
// and dS run under the other's products. BK = 128 at head_dim 128 (wider S and dP products, half the steps) fits only
// serially: S, then P packed to 16 bits, then dP, dS from the packed P (64 + 64 + 32 + 32 at most); the host picks it
// with TANDEM_ATTENTION_BWD_DQ_BLOCK_KV=128 (attention_bwd.cu), for A/B runs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/attention_bwd_wgmma_sm90.cuh"  // WgKernelParams, issueSS, unpackPair, Role, register split

namespace tandem::kernels::attn_bwd::wg {

// ---------------------------------------------------------------------------------------------------------------
// Geometry (shared with the host launcher in attention_bwd.cu).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kDqBlockQ = 64 * kConsumerWarpgroups;  // query rows per CTA: 64 per consumer warpgroup
template <int HD>
inline constexpr int kDqBlockKv = HD == 64 ? 128 : 64;  // default keys per step (see the header comment)
// S then dP, not both in flight: where both would not fit in registers next to dQ (see the header comment).
template <int HD, int BK>
inline constexpr bool kDqSerial = HD / 2 + BK > 160;
// K / V ring depth: 3, or 2 where 3 would not fit in shared memory (head_dim 128 with 128 keys per step: 192 KiB).
template <int HD, int BK>
inline constexpr int kDqStages = HD * BK > 128 * 64 ? 2 : 3;
static_assert(kRowPad % kDqBlockQ == 0, "lse / D rows are padded to whole query blocks");

template <int HD, int BK>
struct DqSharedStorage {
  alignas(1024) uint16_t q[kDqBlockQ * HD];
  alignas(1024) uint16_t dout[kDqBlockQ * HD];
  static constexpr int kStages = kDqStages<HD, BK>;
  alignas(1024) uint16_t k[kStages][BK * HD];
  alignas(1024) uint16_t v[kStages][BK * HD];
  alignas(8) uint64_t fullQ;  // Q and dO landed (one phase per CTA)
  uint64_t full[kStages];     // K and V of the stage landed (the producer's expect_tx)
  uint64_t empty[kStages];    // both consumer warpgroups are done reading the stage
};
template <int HD, int BK>
inline constexpr size_t kDqSmemBytes = sizeof(DqSharedStorage<HD, BK>) + 1024;  // + slack to align the base
static_assert(kDqSmemBytes<128, 128> <= 227 * 1024 && kDqSmemBytes<128, 64> <= 227 * 1024 &&
                  kDqSmemBytes<64, 128> <= 227 * 1024,
              "opt-in shared memory");

// KV steps of the query block starting at row0: every key block up to the last key its last row sees (causal; rows
// past sq do not widen the window). Identical for producer and consumers.
template <int BK>
__device__ __forceinline__ int32_t dqStepsOf(const BwdKernelParams& p, int32_t row0) {
  int64_t keys = p.sk;
  if (p.causal) {
    const int32_t last = min(row0 + kDqBlockQ, p.sq) - 1;
    const int64_t upTo = p.qStart + last - p.kStart + 1;  // keys at positions <= the last row's
    keys = upTo < 0 ? 0 : (upTo < keys ? upTo : keys);
  }
  return static_cast<int32_t>((keys + BK - 1) / BK);
}

// ---------------------------------------------------------------------------------------------------------------
// Producer: ONE thread.
// ---------------------------------------------------------------------------------------------------------------
template <int HD, int BK>
__device__ __forceinline__ void runDqProducer(const WgKernelParams& p, DqSharedStorage<HD, BK>& s, int32_t qBlock,
                                              int32_t head) {
  const BwdKernelParams& b = p.b;
  const int32_t row0 = qBlock * kDqBlockQ;
  const int32_t steps = dqStepsOf<BK>(b, row0);
  if (steps == 0) return;  // the consumers store zeros without waiting on anything
  const int32_t kvHead = head / b.group;
  gemm::mbarArriveExpectTx(&s.fullQ, 2 * kDqBlockQ * HD * 2);  // full boxes: rows past sq count too (zero-filled)
#pragma unroll
  for (int h = 0; h < HD / kSwizzleCols; ++h) {
    const int32_t col = head * HD + h * kSwizzleCols;
    gemm::tmaLoad2d(&p.tmQ, s.q + h * kDqBlockQ * kSwizzleCols, &s.fullQ, col, row0);
    gemm::tmaLoad2d(&p.tmDout, s.dout + h * kDqBlockQ * kSwizzleCols, &s.fullQ, col, row0);
  }
  gemm::PipeState<kDqStages<HD, BK>> ps;
  for (int32_t it = 0; it < steps; ++it) {
    // Parity trick: the first pass waits on parity 1, which a fresh barrier reports as complete. Pairs with the
    // consumers' release (mbarArrive on empty after their last read of the stage).
    gemm::mbarWait(&s.empty[ps.stage], ps.phase ^ 1);
    gemm::mbarArriveExpectTx(&s.full[ps.stage], 2 * BK * HD * 2);  // keys past sk count too (zero-filled)
#pragma unroll
    for (int h = 0; h < HD / kSwizzleCols; ++h) {
      const int32_t col = kvHead * HD + h * kSwizzleCols;
      gemm::tmaLoad2d(&p.tmK, s.k[ps.stage] + h * BK * kSwizzleCols, &s.full[ps.stage], col, it * BK);
      gemm::tmaLoad2d(&p.tmV, s.v[ps.stage] + h * BK * kSwizzleCols, &s.full[ps.stage], col, it * BK);
    }
    ps.advance();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer pieces. Accumulator layout as in device/attention_bwd_wgmma_sm90.cuh: thread t holds rows
// r = 16 (t / 32) + (t % 32) / 4 and r + 8, columns 8 j + 2 (t % 4) + {0, 1} (acc[4 j + 2 h + {0, 1}] is row r + 8 h).
// ---------------------------------------------------------------------------------------------------------------
// Keys [0, lim[h]) of the step starting at key0 are visible to this thread's row rowR + 8 h: those before sk and
// (causal) at or before the row's position.
template <int BK>
__device__ __forceinline__ void dqMaskLimits(const BwdKernelParams& p, int32_t rowR, int32_t key0, int32_t (&lim)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int64_t visible = static_cast<int64_t>(p.sk) - key0;
    if (p.causal) {
      const int64_t upTo = p.qStart + rowR + 8 * h - p.kStart - key0 + 1;
      visible = upTo < visible ? upTo : visible;
    }
    lim[h] = visible <= 0 ? 0 : (visible >= BK ? BK : static_cast<int32_t>(visible));
  }
}

// P of one step in place of S (queries are rows, the step's keys columns). lse2 = +inf (padded rows, rows that see
// no key) gives 0.
template <int BK>
__device__ __forceinline__ void rowProbs(float (&sacc)[BK / 2], const float (&lse2)[2], float scaleLog2, bool mask,
                                         const int32_t (&lim)[2], int t) {
  const int c2 = 2 * (t % 4);
#pragma unroll
  for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float pv = exp2Approx(fmaf(sacc[4 * j + e], scaleLog2, -lse2[e >> 1]));
      if (mask && 8 * j + c2 + (e & 1) >= lim[e >> 1]) pv = 0.0f;
      sacc[4 * j + e] = pv;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Consumer warpgroup wg (0 or 1): query rows [64 wg, 64 wg + 64) of the block; t = thread index in the warpgroup.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int HD, int BK>
__device__ __forceinline__ void runDqConsumer(const WgKernelParams& params, DqSharedStorage<HD, BK>& s, int32_t qBlock,
                                              int32_t head, int wg, int t) {
  const BwdKernelParams& p = params.b;
  const int lane = t % 32;
  const int32_t row0 = qBlock * kDqBlockQ;
  const int32_t rowW = row0 + wg * 64;                   // this warpgroup's first row
  const int32_t rowR = rowW + (t / 32) * 16 + lane / 4;  // this thread's rows: rowR and rowR + 8
  const int32_t steps = dqStepsOf<BK>(p, row0);

  // Rows are padded to kRowPad (a multiple of kDqBlockQ) in the workspace: no bounds checks.
  float lse2[2], dot[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t w = static_cast<int64_t>(head) * p.sqPad + rowR + 8 * h;
    lse2[h] = p.rowLse2[w];
    dot[h] = p.rowDot[w];
  }

  float dq[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dq[i] = 0.0f;

  if (steps > 0) {
    // This warpgroup's 64 rows of Q and dO: 64 rows of 128 bytes into each half.
    const uint32_t qAddr = gemm::smemAddr(s.q) + wg * 64 * 128, doAddr = gemm::smemAddr(s.dout) + wg * 64 * 128;
    gemm::mbarWait(&s.fullQ, 0);  // acquire: Q and dO landed
    gemm::PipeState<kDqStages<HD, BK>> ps;
    int prevStage = 0;
    // dS fragments of the step whose dQ product may still be in flight: kept live across the next step's S and dP
    // (fenceRegs below), so that their accumulators are not given these registers while the wgmma reads them.
    uint32_t dsf[BK / 4];
    for (int32_t it = 0; it < steps; ++it) {
      const int32_t key0 = it * BK;
      const uint32_t kAddr = gemm::smemAddr(s.k[ps.stage]), vAddr = gemm::smemAddr(s.v[ps.stage]);
      gemm::mbarWait(&s.full[ps.stage], ps.phase);  // acquire: K and V of the step landed

      // Masking: keys past sk, or (causal) keys past this warpgroup's first row. Warpgroup-uniform.
      const bool mask = key0 + BK > p.sk || (p.causal && p.kStart + key0 + BK - 1 > p.qStart + rowW);
      int32_t lim[2] = {BK, BK};
      if (mask) dqMaskLimits<BK>(p, rowR, key0, lim);

      // Once the previous step's dQ product is done: its dS registers may be reused, its stage refilled.
      const auto releasePrevious = [&](int32_t step) {
        if (step == 0) return;
        attn::fenceRegs(dsf);
        // release: every read of the previous stage (K and V by completed wgmmas); pairs with the producer's empty
        // wait.
        if (t == 0) gemm::mbarArrive(&s.empty[prevStage]);
      };
      float sacc[BK / 2], dp[BK / 2];
      if constexpr (kDqSerial<HD, BK>) {
        issueSS<T, HD, BK, kDqBlockQ>(sacc, qAddr, kAddr);
        gemm::wgmmaWait<0>();  // the previous dQ product and S done
        gemm::fenceAccumulators(sacc);
        releasePrevious(it);
        rowProbs<BK>(sacc, lse2, p.scaleLog2, mask, lim, t);
        uint32_t pf[BK / 4];
        attn::packP<T, BK>(pf, sacc);
        issueSS<T, HD, BK, kDqBlockQ>(dp, doAddr, vAddr);
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(dp);
#pragma unroll
        for (int i = 0; i < BK / 4; ++i) {  // pf[i] holds P of elements 2 i, 2 i + 1 (row rowR + 8 (i % 2))
          const float2 pv = unpackPair<T>(pf[i]);
          dp[2 * i] = pv.x * (dp[2 * i] - dot[i & 1]);
          dp[2 * i + 1] = pv.y * (dp[2 * i + 1] - dot[i & 1]);
        }
      } else {
        // In flight after these two: the previous step's dQ product, S, dP (groups complete in order). P's exp2 runs
        // while dP is computed.
        issueSS<T, HD, BK, kDqBlockQ>(sacc, qAddr, kAddr);
        issueSS<T, HD, BK, kDqBlockQ>(dp, doAddr, vAddr);
        gemm::wgmmaWait<1>();  // the previous dQ product and S done
        gemm::fenceAccumulators(sacc);
        releasePrevious(it);
        rowProbs<BK>(sacc, lse2, p.scaleLog2, mask, lim, t);
        gemm::wgmmaWait<0>();
        gemm::fenceAccumulators(dp);
#pragma unroll
        for (int i = 0; i < BK / 2; ++i) dp[i] = sacc[i] * (dp[i] - dot[(i >> 1) & 1]);
      }
      attn::packP<T, BK>(dsf, dp);

      // dQ += dS K (k = the step's keys, N = head dim, B read N-major from the K tile); waited for in the next step.
      attn::issuePV<T, HD, BK>(dq, dsf, kAddr);
      prevStage = ps.stage;
      ps.advance();
    }
    // The last dQ product. Its stage is never refilled: no release.
    gemm::wgmmaWait<0>();
    gemm::fenceAccumulators(dq);
    attn::fenceRegs(dsf);
  }

  // dQ = scale dS K; rows past sq dropped. Element (row rowR + 8 h, dim 8 j + 2 (t % 4) ..).
  T* const out = static_cast<T*>(p.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int32_t row = rowR + 8 * h;
    if (row >= p.sq) continue;
    const int64_t off = (static_cast<int64_t>(row) * p.heads + head) * HD + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
      *reinterpret_cast<uint32_t*>(out + off + 8 * j) =
          gemm::packPair<T>(dq[4 * j + 2 * h] * p.scale, dq[4 * j + 2 * h + 1] * p.scale);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A whole CTA: call from a __global__ with __launch_bounds__(kThreads, 1), kThreads threads and kDqSmemBytes<HD, BK>
// of dynamic shared memory.
// ---------------------------------------------------------------------------------------------------------------
template <class T, int HD, int BK>
__device__ __forceinline__ void runDqCta(const WgKernelParams& p, uint8_t* smemRaw, int32_t qBlock, int32_t head) {
  static_assert(HD == 64 || HD == 128, "head dim");
  static_assert(BK == 64 || BK == 128, "keys per step");
  auto& s = *reinterpret_cast<DqSharedStorage<HD, BK>*>((reinterpret_cast<uintptr_t>(smemRaw) + 1023) &
                                                        ~static_cast<uintptr_t>(1023));
  const int wgIdx = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int t = static_cast<int>(threadIdx.x) % 128;
  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads) __trap();  // geometry: the host launches kThreads
    gemm::mbarInit(&s.fullQ, 1);
#pragma unroll
    for (int i = 0; i < kDqStages<HD, BK>; ++i) {
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
      if (t == 0) runDqProducer<HD, BK>(p, s, qBlock, head);
      break;
    case Role::kConsumer:
      gemm::setMaxNRegInc<kConsumerRegs>();
      runDqConsumer<T, HD, BK>(p, s, qBlock, head, wgIdx - 1, t);
      break;
  }
}

}  // namespace tandem::kernels::attn_bwd::wg
