/* The C side of the per-call overhead measurement (python/bench/overhead.py): the same op, shape and memory as the
 * Python loop, called straight through the C ABI. Prints one line: "<op> <backend> <ns per call>" (the median of
 * 7 repeats of `iters` calls).
 *
 * usage: overhead_baseline OP ITERS   (OP: barrier or gemm_ar; socket from $TANDEM_SOCKET or the default)
 * cpu backend: each call submits and waits (the op is synchronous there, as in Python). cuda backend: each call
 * only enqueues on the legacy default stream; the loop's ops are waited for after the timed part. */
#define _POSIX_C_SOURCE 199309L  /* clock_gettime under -std=c11 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tandem/tandem.h"

static double nowNs(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void check(tandem_status_t s, const char* what) {
  if (s != TANDEM_SUCCESS) {
    fprintf(stderr, "%s failed: %s: %s\n", what, tandem_strerror(s), tandem_last_error());
    exit(1);
  }
}

static int cmp(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s barrier|gemm_ar ITERS\n", argv[0]);
    return 2;
  }
  const int gemm = strcmp(argv[1], "gemm_ar") == 0;
  const int iters = atoi(argv[2]);
  tandem_session_t s;
  check(tandem_connect(NULL, &s), "tandem_connect");
  const int cuda = strcmp(tandem_session_backend(s), "cuda") == 0;
  tandem_unique_id_t id;
  check(tandem_get_unique_id(&id), "tandem_get_unique_id");
  tandem_comm_t comm;
  check(tandem_comm_init(s, &id, 1, 0, 30000, &comm), "tandem_comm_init");
  const uint64_t m = 8, n = 8, k = 8;
  const tandem_dtype_t dt = cuda ? TANDEM_DTYPE_BF16 : TANDEM_DTYPE_FP32;  /* the GPU GEMMs take bf16/fp16 */
  tandem_buffer_t a, b, c;
  check(tandem_alloc(s, m * k * 4, &a), "alloc a");
  check(tandem_alloc(s, n * k * 4, &b), "alloc b");
  check(tandem_alloc(s, m * n * 4, &c), "alloc c");
  if (!cuda) {
    memset(tandem_buffer_ptr(a), 0, m * k * 4);
    memset(tandem_buffer_ptr(b), 0, n * k * 4);
  }
  tandem_gemm_ar_args_t g = {sizeof g, dt, m, n, k, {a, 0}, {b, 0}, {c, 0}, NULL};
  tandem_barrier_args_t br = {sizeof br, NULL};
  double per[7];
  for (int rep = 0; rep < 7; ++rep) {
    tandem_op_t op = {0, 0};
    const double t0 = nowNs();
    for (int i = 0; i < iters; ++i) {
      check(gemm ? tandem_gemm_ar(comm, &g, &op) : tandem_barrier_stream(comm, &br, &op), argv[1]);
      if (!cuda) check(tandem_wait(op, -1), "tandem_wait");
    }
    per[rep] = (nowNs() - t0) / iters;
    if (cuda) check(tandem_wait(op, 60000), "tandem_wait (last op)");
  }
  qsort(per, 7, sizeof per[0], cmp);
  printf("%s %s %.0f\n", argv[1], cuda ? "cuda" : "cpu", per[3]);
  tandem_free(a);
  tandem_free(b);
  tandem_free(c);
  tandem_comm_destroy(comm);
  tandem_disconnect(s);
  return 0;
}
