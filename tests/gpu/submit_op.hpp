// The GPU tests' one translation from an op descriptor to the C API: fills the op's argument struct from the
// descriptor's dims and flags and enqueues it on `stream`. `tensor(s)` gives the tensor of buffer slot s.
#pragma once

#include "tandem/common/descriptor.hpp"
#include "tandem/tandem.h"

namespace tandem::gputest {

// Ring attention's forward and backward share their shape fields and q, k, v.
template <class Args, class TensorOf>
Args attentionArgs(const OpDescriptor& d, const TensorOf& tensor, void* stream) {
  Args a{};
  a.struct_size = sizeof a;
  a.dtype = static_cast<tandem_dtype_t>(d.dtype);
  a.seq = d.dims[dim::kSeq];
  a.heads = d.dims[dim::kHeads];
  a.head_dim = d.dims[dim::kHeadDim];
  a.kv_heads = d.dims[dim::kKvHeads];
  a.causal = (d.flags & kFlagCausal) != 0;
  a.layout = (d.flags & kFlagZigzag) != 0 ? TANDEM_ATTENTION_ZIGZAG : TANDEM_ATTENTION_CONTIGUOUS;
  a.scale = d.scale;
  a.q = tensor(slot::kQ);
  a.k = tensor(slot::kKey);
  a.v = tensor(slot::kValue);
  a.cuda_stream = stream;
  return a;
}

// The GEMM ops with every field of their descriptor: the layout, and FP8's output dtype, scaling and scales.
template <class TensorOf>
tandem_status_t submitGemmOp(const OpDescriptor& d, const TensorOf& tensor, tandem_comm_t comm, void* stream,
                             tandem_op_t* op) {
  const auto dtype = static_cast<tandem_dtype_t>(d.dtype);
  const auto layout = static_cast<tandem_gemm_layout_t>(gemmOperandsOf(d.flags));
  const auto outDtype = static_cast<tandem_dtype_t>((d.flags & kFlagGemmOutDtype) >> kGemmOutDtypeShift);
  const auto scaling = (d.flags & kFlagFp8BlockScale) != 0 ? TANDEM_FP8_SCALE_BLOCK : TANDEM_FP8_SCALE_TENSOR;
  const tandem_tensor_t aScale = tensor(gemmScaleSlot(d.kind, false)), bScale = tensor(gemmScaleSlot(d.kind, true));
  const uint64_t m = d.dims[dim::kM], n = d.dims[dim::kN], k = d.dims[dim::kK];
  if (d.kind == OpKind::kAgGemm) {
    const tandem_ag_gemm_args_t a{sizeof a, dtype,  m,        n,       k,      tensor(slot::kA),
                                  tensor(slot::kB), tensor(slot::kC), tensor(slot::kAGathered), stream,
                                  layout,   outDtype, scaling, aScale, bScale};
    return tandem_ag_gemm(comm, &a, op);
  }
  if (d.kind == OpKind::kGemmRs) {
    const tandem_gemm_rs_args_t a{sizeof a, dtype,  m,        n,       k,      tensor(slot::kA), tensor(slot::kB),
                                  tensor(slot::kC), stream, layout, outDtype, scaling, aScale, bScale};
    return tandem_gemm_rs(comm, &a, op);
  }
  const tandem_gemm_ar_args_t a{sizeof a, dtype,  m,        n,       k,      tensor(slot::kA), tensor(slot::kB),
                                tensor(slot::kC), stream, layout, outDtype, scaling, aScale, bScale};
  return tandem_gemm_ar(comm, &a, op);
}

template <class TensorOf>
tandem_status_t submitOp(const OpDescriptor& d, const TensorOf& tensor, tandem_comm_t comm, void* stream,
                         tandem_op_t* op) {
  const auto dtype = static_cast<tandem_dtype_t>(d.dtype);
  switch (d.kind) {
    case OpKind::kAllGather: {
      const tandem_allgather_args_t a{sizeof a, tensor(slot::kSend), tensor(slot::kRecv), d.dims[dim::kBytes], stream};
      return tandem_allgather(comm, &a, op);
    }
    case OpKind::kNop: {
      const tandem_barrier_args_t a{sizeof a, stream};
      return tandem_barrier_stream(comm, &a, op);
    }
    case OpKind::kAgGemm:
    case OpKind::kGemmRs:
    case OpKind::kGemmAr: return submitGemmOp(d, tensor, comm, stream, op);
    case OpKind::kRingAttention: {
      auto a = attentionArgs<tandem_ring_attention_args_t>(d, tensor, stream);
      a.out = tensor(slot::kAttnOut);
      a.lse = tensor(slot::kAttnLse);
      return tandem_ring_attention(comm, &a, op);
    }
    case OpKind::kRingAttentionBackward: {
      auto a = attentionArgs<tandem_ring_attention_backward_args_t>(d, tensor, stream);
      a.o = tensor(slot::kAttnOut);
      a.dout = tensor(slot::kDout);
      a.lse = tensor(slot::kBwdLse);
      a.dq = tensor(slot::kDq);
      a.dk = tensor(slot::kDk);
      a.dv = tensor(slot::kDv);
      return tandem_ring_attention_backward(comm, &a, op);
    }
    case OpKind::kMoeDispatchGemm: {
      const auto wDtype = static_cast<tandem_dtype_t>((d.flags & kFlagMoeWeightDtype) >> kMoeWeightDtypeShift);
      const tandem_moe_dispatch_gemm_args_t a{
          sizeof a, dtype, d.dims[dim::kTokens], d.dims[dim::kHidden], d.dims[dim::kNOut], d.dims[dim::kExperts],
          d.dims[dim::kTopk], d.dims[dim::kCapacity], tensor(slot::kX), tensor(slot::kTopkIds),
          tensor(slot::kTopkWeights), tensor(slot::kW), tensor(slot::kMoeOut), tensor(slot::kRowInfo),
          tensor(slot::kExpertCounts), stream, wDtype, tensor(slot::kMoeWScale)};
      return tandem_moe_dispatch_gemm(comm, &a, op);
    }
    case OpKind::kMoeDispatchFfnCombine: {
      const auto wDtype = static_cast<tandem_dtype_t>((d.flags & kFlagMoeWeightDtype) >> kMoeWeightDtypeShift);
      const tandem_moe_ffn_args_t a{sizeof a, dtype, d.dims[dim::kTokens], d.dims[dim::kHidden], d.dims[dim::kFfn],
                                    d.dims[dim::kExperts], d.dims[dim::kTopk], tensor(slot::kX), tensor(slot::kTopkIds),
                                    tensor(slot::kTopkWeights), tensor(slot::kW1), tensor(slot::kW2),
                                    tensor(slot::kFfnOut), stream, d.dims[dim::kSavedRows],
                                    tensor(slot::kFfnSaved), wDtype, tensor(slot::kFfnW1Scale),
                                    tensor(slot::kFfnW2Scale)};
      return tandem_moe_dispatch_ffn_combine(comm, &a, op);
    }
    case OpKind::kMoeFfnBackward: {
      const tandem_moe_ffn_backward_args_t a{
          sizeof a, dtype, d.dims[dim::kTokens], d.dims[dim::kHidden], d.dims[dim::kFfn], d.dims[dim::kExperts],
          d.dims[dim::kTopk], tensor(slot::kX), tensor(slot::kTopkIds), tensor(slot::kTopkWeights), tensor(slot::kW1),
          tensor(slot::kW2), tensor(slot::kMoeDout), tensor(slot::kMoeDx), tensor(slot::kMoeDtopkWeights),
          tensor(slot::kMoeDw1), tensor(slot::kMoeDw2), stream, d.dims[dim::kSavedRows], tensor(slot::kMoeBwdSaved)};
      return tandem_moe_dispatch_ffn_combine_backward(comm, &a, op);
    }
    default: return TANDEM_ERROR_INVALID_ARGUMENT;
  }
}

}  // namespace tandem::gputest
