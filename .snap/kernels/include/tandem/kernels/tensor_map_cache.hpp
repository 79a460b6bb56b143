// TMA descriptors (CUtensorMap) of row-major tensors (2-byte elements with the 128-byte swizzle by default; fp8 bytes
// and unswizzled fp32 scales for the FP8 grouped GEMM), and a small cache of them, shared by the GEMM core's launcher (gemm.cu) and the grouped GEMM's (grouped_gemm.cpp). Host-only; compiles
// under g++ and nvcc (no fmt): the callers turn a failed encode into their own error.
#pragma once

#include <cuda.h>  // CUtensorMap, CUresult (types only; the encoder comes through driver.hpp)

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "tandem/kernels/driver.hpp"
#include "tandem/kernels/gemm.hpp"  // GemmDtype

namespace tandem::kernels {

/// A tensor map's element type: kDtype takes TensorMapKey::dtype (bf16 or fp16); kU8 holds fp8 bytes; kF32 fp32 scales.
enum class TensorMapElem : uint8_t { kDtype = 0, kU8 = 1, kF32 = 2 };

/// A tensor of up to 4 dims, innermost first: dims[0] elements are contiguous; strides (bytes) are those of dims
/// 1..rank-1; box is the tile one TMA copy moves.
struct TensorMapKey {
  const void* ptr = nullptr;
  uint32_t rank = 2;
  std::array<uint64_t, 4> dims{1, 1, 1, 1};
  std::array<uint64_t, 3> strides{};
  std::array<uint32_t, 4> box{1, 1, 1, 1};
  GemmDtype dtype = GemmDtype::kBf16;
  TensorMapElem elem = TensorMapElem::kDtype;
  bool swizzle128 = true;  // false: no swizzle (a box of scales, read as a plain array)
  bool operator==(const TensorMapKey& o) const {
    return ptr == o.ptr && rank == o.rank && dims == o.dims && strides == o.strides && box == o.box &&
           dtype == o.dtype && elem == o.elem && swizzle128 == o.swizzle128;
  }

  /// A row-major [rows, cols] matrix with row stride ld elements, tiled in boxRows x boxCols boxes.
  static TensorMapKey matrix(const void* ptr, uint64_t rows, uint64_t cols, uint64_t ld, uint32_t boxRows,
                             uint32_t boxCols, GemmDtype dtype) {
    TensorMapKey k;
    k.ptr = ptr;
    k.rank = 2;
    k.dims = {cols, rows, 1, 1};
    k.strides = {ld * 2, 0, 0};
    k.box = {boxCols, boxRows, 1, 1};
    k.dtype = dtype;
    return k;
  }
};

/// Encodes `k` (its swizzle, 256-byte L2 promotion, zeros out of bounds) into `map`. Returns the driver's result.
/// @throws std::runtime_error when the driver's entry point cannot be loaded (driver.hpp).
inline CUresult encodeTensorMap(const TensorMapKey& k, CUtensorMap* map) {
  std::array<cuuint64_t, 4> dims{};
  std::array<cuuint64_t, 3> strides{};
  std::array<cuuint32_t, 4> box{};
  const std::array<cuuint32_t, 4> elemStrides{1, 1, 1, 1};
  for (uint32_t i = 0; i < k.rank && i < 4; ++i) {
    dims[i] = k.dims[i];
    box[i] = k.box[i];
    if (i + 1 < k.rank) strides[i] = k.strides[i];
  }
  const CUtensorMapDataType dt = k.elem == TensorMapElem::kU8    ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                 : k.elem == TensorMapElem::kF32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                 : k.dtype == GemmDtype::kBf16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return tensorMapEncodeTiled()(map, dt, k.rank, const_cast<void*>(k.ptr), dims.data(), strides.data(), box.data(),
                                elemStrides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
                                k.swizzle128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

/// Encoding costs about a microsecond of host time; a hit costs a short scan of 64 entries. Round-robin eviction;
/// only successful encodes are kept. Thread-safe. Keyed by pointer: a freed and reallocated tensor at the same address
/// with the same shape gets the same (still valid) descriptor.
class TensorMapCache {
 public:
  /// The descriptor of `k` into `map`, from the cache or freshly encoded. Returns the encode's result.
  CUresult get(const TensorMapKey& k, CUtensorMap* map) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < size_; ++i) {
        if (entries_[i].key == k) {
          *map = entries_[i].map;
          return CUDA_SUCCESS;
        }
      }
    }
    const CUresult r = encodeTensorMap(k, map);  // outside the lock
    if (r != CUDA_SUCCESS) return r;
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = size_ < entries_.size() ? entries_[size_++] : entries_[next_++ % entries_.size()];
    e.key = k;
    e.map = *map;
    return CUDA_SUCCESS;
  }

 private:
  struct Entry {
    TensorMapKey key;
    CUtensorMap map;
  };
  std::mutex mu_;
  std::array<Entry, 64> entries_{};
  size_t size_ = 0;
  size_t next_ = 0;
};

}  // namespace tandem::kernels
