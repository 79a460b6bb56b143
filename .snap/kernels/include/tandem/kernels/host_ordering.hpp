// The host's side of every word tandem shares with kernels, streams or another process (the control page, the
// daemon executor's work queue), named <op><Semantic> as device/ordering.cuh names the device's: no bare
// std::atomic_ref elsewhere. Each call site names the access it pairs with.
//
// The words live in plain structs (a layout shared with nvcc), so the host reaches them through std::atomic_ref;
// every access of a shared word goes through one of these, never a plain load or store.
#pragma once

#include <atomic>
#include <cstdint>

namespace tandem::kernels {

template <typename T>
inline T ldAcquire(const T& word) noexcept {
  return std::atomic_ref<const T>(word).load(std::memory_order_acquire);
}
template <typename T>
inline void stRelease(T& word, T value) noexcept {
  std::atomic_ref<T>(word).store(value, std::memory_order_release);
}
// Sequentially consistent: a store before a load of another word cannot be reordered with it (the Dekker handshakes
// with the persistent kernel, whose side is fenceScSys).
template <typename T>
inline T ldSeqCst(const T& word) noexcept {
  return std::atomic_ref<const T>(word).load(std::memory_order_seq_cst);
}
template <typename T>
inline void stSeqCst(T& word, T value) noexcept {
  std::atomic_ref<T>(word).store(value, std::memory_order_seq_cst);
}

}  // namespace tandem::kernels
