#include "c_args.hpp"

#include <cstddef>
#include <cstring>

#include "tandem/common/error.hpp"

namespace tandem::client {
namespace {

template <typename T>
T read(const void* args, std::size_t offset) {
  T v;
  std::memcpy(&v, static_cast<const char*>(args) + offset, sizeof v);
  return v;
}

}  // namespace

CArgs unpackArgs(const OpSpec& spec, const void* args) {
  const CArgsLayout layout = cArgsLayout(spec);
  // The required prefix ends at cuda_stream: every struct had it last when first released.
  std::size_t required = layout.size;
  bool appended = false;
  for (int f = 0; f < spec.cFieldCount; ++f) {
    const auto i = static_cast<std::size_t>(f);
    if (spec.cFields[i].kind == CField::Kind::kStream) {
      required = layout.offsets[i] + cFieldBytes(CField::Kind::kStream);
      appended = f + 1 < spec.cFieldCount;
    }
  }
  std::size_t structSize = 0;
  if (args != nullptr) structSize = read<std::size_t>(args, 0);
  if (args == nullptr || structSize < required) {
    if (appended) {
      fail(ErrorCode::kInvalidArgument, "args is NULL or args->struct_size is smaller than the 0.2 {}; set "
           "struct_size = sizeof({})", spec.cStruct, spec.cStruct);
    }
    fail(ErrorCode::kInvalidArgument, "args is NULL or args->struct_size is not sizeof({})", spec.cStruct);
  }

  CArgs out;
  out.desc.kind = spec.kind;
  out.tensorCount = spec.slotCount;
  for (int f = 0; f < spec.cFieldCount; ++f) {
    const CField& cf = spec.cFields[static_cast<std::size_t>(f)];
    const std::size_t at = layout.offsets[static_cast<std::size_t>(f)];
    if (structSize < at + cFieldBytes(cf.kind)) continue;  // appended after the caller's version: 0, absent
    switch (cf.kind) {
      case CField::Kind::kDtype: out.desc.dtype = static_cast<DType>(read<tandem_dtype_t>(args, at)); break;
      case CField::Kind::kDim: out.desc.dims[cf.index] = read<uint64_t>(args, at); break;
      case CField::Kind::kFlag: {
        const int v = read<int>(args, at);
        if (cf.isEnum && (v < 0 || v > cf.maxValue)) {
          fail(ErrorCode::kInvalidArgument, "{}: {} {} is unknown; pass {}", spec.cArgsFunction, cf.name, v,
               cf.values);
        }
        const unsigned bits = cf.isEnum ? static_cast<unsigned>(v) : (v != 0 ? 1U : 0U);
        out.desc.flags = static_cast<uint16_t>(out.desc.flags | (bits << cf.index));
        break;
      }
      case CField::Kind::kScale: out.desc.scale = read<float>(args, at); break;
      case CField::Kind::kTensor: out.tensors[cf.index] = read<tandem_tensor_t>(args, at); break;
      case CField::Kind::kStream: out.stream = read<void*>(args, at); break;
    }
  }
  for (int i = 0; i < spec.dimCount; ++i) {
    const DimSpec& ds = spec.dims[static_cast<std::size_t>(i)];
    if (ds.zeroMeans >= 0 && out.desc.dims[static_cast<std::size_t>(i)] == 0) {
      out.desc.dims[static_cast<std::size_t>(i)] = out.desc.dims[static_cast<std::size_t>(ds.zeroMeans)];
    }
  }
  return out;
}

}  // namespace tandem::client
