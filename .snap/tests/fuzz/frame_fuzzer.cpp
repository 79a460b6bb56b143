// libFuzzer target: the frame decoder must never crash, never return a frame over its limit, and reject
// oversized lengths only with Error(kProtocol).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "tandem/common/error.hpp"
#include "tandem/common/framing.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr std::size_t kLimit = 512;
  tandem::FrameDecoder decoder(kLimit);
  try {
    std::size_t pos = 0;
    // The first byte picks the chunk size, so the fuzzer also explores how frames are split across reads.
    const std::size_t chunk = size > 0 ? (data[0] % 31) + 1 : 1;
    while (pos < size) {
      const std::size_t n = std::min(chunk, size - pos);
      decoder.append({reinterpret_cast<const std::byte*>(data + pos), n});
      pos += n;
      while (auto frame = decoder.next()) {
        if (frame->size() > kLimit) std::abort();
      }
    }
  } catch (const tandem::Error& e) {
    if (e.code() != tandem::ErrorCode::kProtocol) std::abort();
  }
  return 0;
}
