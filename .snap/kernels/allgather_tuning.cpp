// AllGather's tuning: which protocol, how many CTAs and which chunk size for a shard size (allgather.hpp says the
// rules). Host code; reads the TANDEM_AG_* overrides on every call.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "tandem/kernels/allgather.hpp"

namespace tandem::kernels {
namespace {

uint64_t envU64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 0);
}

uint32_t pow2Floor(uint64_t x) {
  uint32_t p = 1;
  while (uint64_t{p} * 2 <= x && p < (1u << 30)) p *= 2;
  return p;
}

uint32_t pow2Ceil(uint64_t x) {
  uint32_t p = 1;
  while (uint64_t{p} < x && p < (1u << 30)) p *= 2;
  return p;
}

}  // namespace

AgTuning allgatherTuning(uint64_t bytes, uint32_t maxCtas) {
  // Read on every call (a few hundred ns), so a benchmark can switch between ops; every rank must agree.
  const uint64_t envCtas = envU64("TANDEM_AG_CTAS", 0);
  const uint64_t envChunk = envU64("TANDEM_AG_CHUNK", 0);
  const char* m = std::getenv("TANDEM_AG_MODE");
  const AgMode envMode = (m != nullptr && std::strcmp(m, "pull") == 0) ? AgMode::kPull : AgMode::kPush;
  // Default CTA cap, measured on two H200s (bench/RESULTS.md): from 64 MiB per rank 64 pushing CTAs
  // beat 32 (241 vs 209 GB/s bus bandwidth at 64 MiB, 299 vs 228 at 256 MiB, 322 vs 233 at 1 GiB) and beat NCCL; below
  // 32 MiB the extra CTAs only add flag traffic.
  uint32_t cap = maxCtas != 0 ? maxCtas : (bytes >= (uint64_t{32} << 20) ? 64 : 32);
  if (envCtas != 0) cap = static_cast<uint32_t>(envCtas);
  cap = pow2Floor(cap < 1 ? 1 : (cap > kAgMaxCtas ? kAgMaxCtas : cap));
  // LL up to TANDEM_AG_LL_MAX (at most the buffers' capacity; 0 disables it), with about one line per thread, from 4
  // to 32 CTAs: 1 KiB per rank takes 4, 64 KiB 16, 128 KiB and more 32. Measured on nvidia-h200-x2 (client executor,
  // 2 ranks, median per op): 4 to 32 CTAs are all within 1 us of each other below 64 KiB (about 15 us); above, more
  // CTAs win (512 KiB: 85 us on 1 CTA, 31 on 4, 18 on 32, 17 on 64). Chunked, the same sizes took 18 to 54 us.
  uint64_t llMax = envU64("TANDEM_AG_LL_MAX", kAgLLMaxBytes);
  if (llMax > kAgLLMaxBytes) llMax = kAgLLMaxBytes;
  const bool ll = llMax != 0 && bytes <= llMax;
  AgTuning t{};
  t.mode = ll ? AgMode::kLL : envMode;
  if (ll) {
    const uint64_t lines = bytes == 0 ? 1 : (bytes + 7) / 8;
    t.numCtas = pow2Ceil((lines + kAgThreads - 1) / kAgThreads);
    if (t.numCtas < 4) t.numCtas = 4;
    if (t.numCtas > 32) t.numCtas = 32;
  } else {
    t.numCtas = pow2Floor(bytes / (16u << 10));
  }
  if (t.numCtas > cap) t.numCtas = cap;
  if (envCtas != 0) t.numCtas = cap;
  uint64_t chunk = (bytes + t.numCtas - 1) / t.numCtas;
  chunk = (chunk + 15) & ~uint64_t{15};
  if (chunk < 4096) chunk = 4096;
  if (chunk > kAgChunkMax) chunk = kAgChunkMax;
  if (envChunk != 0) chunk = envChunk > kAgChunkMax ? kAgChunkMax : ((envChunk + 15) & ~uint64_t{15});
  t.chunkBytes = static_cast<uint32_t>(chunk);
  return t;
}

}  // namespace tandem::kernels
