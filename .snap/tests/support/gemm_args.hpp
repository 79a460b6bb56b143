// The fused GEMM ops' C argument structs as the tests fill them: value-initialised, then the common fields set by
// name. Fields appended later (layout, out_dtype, scaling, a_scale, b_scale) stay zero, which is what the API
// documents as their defaults (TANDEM_GEMM_NT, out_dtype = dtype, no FP8 scales); a test that needs another
// layout or FP8 sets them on the returned struct. Naming the fields keeps positional initialisers from silently
// shifting, and from -Wmissing-field-initializers, each time a field is appended.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tandem/tandem.h"

namespace tandem::testing {

/// tandem_ag_gemm_args_t; a_gathered {nullptr, 0} means none.
inline tandem_ag_gemm_args_t agGemmArgs(tandem_dtype_t dtype, uint64_t m, uint64_t n, uint64_t k, tandem_tensor_t a,
                                        tandem_tensor_t b, tandem_tensor_t c, tandem_tensor_t aGathered,
                                        void* cudaStream) {
  tandem_ag_gemm_args_t args{};
  args.struct_size = sizeof args;
  args.dtype = dtype;
  args.m = m;
  args.n = n;
  args.k = k;
  args.a = a;
  args.b = b;
  args.c = c;
  args.a_gathered = aGathered;
  args.cuda_stream = cudaStream;
  return args;
}

/// tandem_gemm_rs_args_t or tandem_gemm_ar_args_t (the same fields); k is this rank's slice.
template <class Args>
Args gemmArgs(tandem_dtype_t dtype, uint64_t m, uint64_t n, uint64_t k, tandem_tensor_t a, tandem_tensor_t b,
              tandem_tensor_t c, void* cudaStream) {
  static_assert(std::is_same_v<Args, tandem_gemm_rs_args_t> || std::is_same_v<Args, tandem_gemm_ar_args_t>);
  Args args{};
  args.struct_size = sizeof args;
  args.dtype = dtype;
  args.m = m;
  args.n = n;
  args.k = k;
  args.a = a;
  args.b = b;
  args.c = c;
  args.cuda_stream = cudaStream;
  return args;
}

}  // namespace tandem::testing
