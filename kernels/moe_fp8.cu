// The MoE ops' quantising dispatch (FP8 weights, moe_desc.hpp launchDispatchFp8; the FFN forward and dispatch+GEMM):
// each token's bf16 row is quantised to e4m3 once, on its own rank, and the e4m3 bytes with their 1 x 128 scales go to
// every expert the token picked, so the wire carries hidden + hidden / 32 bytes per routed row instead of 2 hidden.
// The rest of the op (route, plan, the FP8 grouped GEMMs, the arrive, the FFN's y exchange and combine) is moe.cu's and
// grouped_gemm_fp8.cu's; moe.cpp sequences them.
//
// Ordering: as moe.cu's dispatch (its rows and row info, then finishDispatch's counted fences and flag release).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_desc.hpp"
#include "moe_dispatch.cuh"

namespace tandem::kernels::moe {
namespace {

constexpr float kE4M3Max = 448.0f;
// The smallest amax a block is quantised with (as the FP8 grouped GEMM's SwiGLU epilogue): keeps 448 / amax finite for
// an all-zero block, whose values then quantise to 0. numeric.cpp's quantizeE4m3Block is the host's copy of this rule.
constexpr float kMinAmax = 1e-30f;
// A lane quantises 16 consecutive columns: one 16-byte store of e4m3 per expert, and 8 lanes make a 1 x 128 block.
constexpr int kLaneCols = 16;
constexpr int kLanesPerBlock = 128 / kLaneCols;
static_assert(kQuantCols == 32 * kLaneCols, "a warp's item is one 16-column piece per lane");

// Work item w = (token t, part): the warp quantises columns [part * kQuantCols, +kQuantCols) of t's row. Lane j < topk
// first finds slot j's owner and row there (and writes the row info once, with part 0); then every lane quantises its
// 16 columns and the warp writes them to each slot's owner in slot order.
__global__ void __launch_bounds__(kCopyWarps * 32) moeDispatchFp8Kernel(const __grid_constant__ MoeKernelParams p) {
  const int32_t state = p.status->state;  // the plan kernel's, earlier in this stream
  if (state == kSkip) return;             // uniform over the grid
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (state == kRun) {
    const int32_t parts = (p.hidden + kQuantCols - 1) / kQuantCols;
    const int32_t items = p.tokens * parts;
    for (int32_t w = static_cast<int32_t>(blockIdx.x) * kCopyWarps + warp; w < items;
         w += static_cast<int32_t>(gridDim.x) * kCopyWarps) {
      const int32_t t = w / parts;
      const int32_t part = w - t * parts;
      int32_t owner = 0, row = 0;
      if (lane < p.topk) {
        const int32_t pi = t * p.topk + lane;
        const int32_t e = p.ids[pi];
        owner = e / p.localExperts;
        row = pairRow(p, pi, t, e);
        if (part == 0) {
          const RecvLayout lay = recvLayoutFp8(p.status->capacity[owner], p.hidden, p.ffn);
          *reinterpret_cast<int4*>(p.recv[owner] + lay.infoOff + static_cast<uint64_t>(row) * 16) =
              make_int4(p.rank, t, lane, e);
        }
      }
      // hidden % 16 == 0 (validateMoe), so a lane's 16 columns are all in the row or all past it.
      const int32_t col = part * kQuantCols + lane * kLaneCols;
      const bool active = col < p.hidden;
      float v[kLaneCols];
      float amax = 0.0f;
      if (active) {
        const auto* src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.x) +
                                                         static_cast<int64_t>(t) * p.hidden + col);
        const uint4 a = src[0], b = src[1];
        const auto* ha = reinterpret_cast<const __nv_bfloat16*>(&a);
        const auto* hb = reinterpret_cast<const __nv_bfloat16*>(&b);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[i] = __bfloat162float(ha[i]);
          v[8 + i] = __bfloat162float(hb[i]);
        }
#pragma unroll
        for (int i = 0; i < kLaneCols; ++i) amax = fmaxf(amax, fabsf(v[i]));
      }
      // The block's 128 columns are the 8 lanes of lane / 8 (a lane past the row adds 0: a last partial block).
#pragma unroll
      for (int d = 1; d < kLanesPerBlock; d *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
      amax = fmaxf(amax, kMinAmax);
      const float inv = kE4M3Max / amax;
      const float scale = amax / kE4M3Max;
      uint4 q = make_uint4(0, 0, 0, 0);
      auto* q2 = reinterpret_cast<__nv_fp8x2_storage_t*>(&q);
#pragma unroll
      for (int i = 0; i < kLaneCols / 2; ++i) {
        q2[i] = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * i] * inv, v[2 * i + 1] * inv), __NV_SATFINITE, __NV_E4M3);
      }
      for (int32_t j = 0; j < p.topk; ++j) {  // warp-uniform
        const int32_t d = __shfl_sync(0xffffffffu, owner, j);
        const int32_t r = __shfl_sync(0xffffffffu, row, j);
        if (!active) continue;
        const RecvLayout lay = recvLayoutFp8(p.status->capacity[d], p.hidden, p.ffn);
        char* const base = p.recv[d];
        *reinterpret_cast<uint4*>(base + lay.xOff + static_cast<uint64_t>(r) * p.hidden + col) = q;
        if (lane % kLanesPerBlock == 0) {
          reinterpret_cast<float*>(base + lay.xScaleOff)[static_cast<uint64_t>(col / 128) * lay.scaleLd + r] = scale;
        }
      }
    }
  }
  finishDispatch(p);
}

}  // namespace

cudaError_t launchDispatchFp8(const MoeKernelParams& p, int ctas, cudaStream_t s) {
  return launchK(&moeDispatchFp8Kernel, ctas, kCopyWarps * 32, s, p);
}

cudaError_t prepareMoeFp8Kernels() { return loadKernel(&moeDispatchFp8Kernel); }

}  // namespace tandem::kernels::moe
