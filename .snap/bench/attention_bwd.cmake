# Attention backward core vs torch SDPA's backward (cuDNN and flash backends; bench/sdpa_bwd_baseline.py runs those in
# the same device call). Included from bench/CMakeLists.txt inside if(TANDEM_HAVE_CUDA). Run on an H100/H200:
# attention_bwd_bench [--iters N] [--seqs 4096,8192,16384] [--hds 128,64] [--causal both|0|1] [--fp16]
# Exits 1 when the two dq modes disagree. Links only the two attention cores.
if(TARGET tandem_attention_bwd)
  add_executable(attention_bwd_bench attention_bwd_bench.cu)
  target_link_libraries(attention_bwd_bench PRIVATE tandem_attention_bwd tandem_attention CUDA::cudart_static)
  set_target_properties(attention_bwd_bench PROPERTIES CUDA_ARCHITECTURES 90a-real)  # -std=c++20 from the libraries
endif()
