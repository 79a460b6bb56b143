// The text tandem names a GPU by, everywhere (config, protocol, status, logs): "GPU-" and the UUID's 16 bytes as
// nvidia-smi -L prints them, never a device ordinal (CUDA_VISIBLE_DEVICES differs between processes).
#pragma once

#include <fmt/format.h>

#include <string>

namespace tandem {

// `bytes`: the 16 bytes of a cudaUUID_t (cudaDeviceProp::uuid.bytes).
inline std::string formatGpuUuid(const char* bytes) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes);
  return fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                     b[15]);
}

}  // namespace tandem
