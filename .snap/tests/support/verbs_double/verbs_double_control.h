/* The verbs test double's own API: fault injection and counters, next to the libibverbs subset it implements.
 *
 * The double is a shared library named libibverbs.so.1 built into its own directory; a test puts that directory
 * first in LD_LIBRARY_PATH, so tandemd and the tests (built against the real rdma-core headers and linked against
 * the real library) load it instead of rdma-core. These functions exist only in the double: a test reaches them
 * through dlsym (tests/support/verbs_double/verbs_double.hpp), which also tells it whether the double is loaded.
 *
 * Faults (the same spec as the TANDEM_VERBS_DOUBLE_FAULTS environment variable, read when the first device is
 * opened), comma-separated key=value:
 *   delay_completions_ms=N    every completion becomes visible to ibv_poll_cq N ms after it happened (order kept)
 *   qp_error_after_writes=N   the Nth RDMA WRITE with data that this process transmits fails instead: its work
 *                             request completes with IBV_WC_RETRY_EXC_ERR, its QP moves to the error state (the rest
 *                             flush with IBV_WC_WR_FLUSH_ERR) and its connection to the responder closes. Once.
 *   vanish_after_writes=N     at the Nth RDMA WRITE with data, this process's HCA disappears (as
 *                             tandem_verbs_double_vanish). Once.
 * An empty spec clears every fault; counters of writes restart at 0.
 */
#ifndef TANDEM_VERBS_DOUBLE_CONTROL_H
#define TANDEM_VERBS_DOUBLE_CONTROL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Replaces the fault set. Returns 0, or EINVAL for a spec it cannot read (nothing changes then). */
int tandem_verbs_double_set_faults(const char* spec);

/* This process's HCA disappears for its peers: its listening socket is removed and every connection closed, so peers
 * see their work requests fail with IBV_WC_RETRY_EXC_ERR; its own QPs move to the error state. Opening the device
 * again (after the last ibv_close_device) brings a fresh HCA back. */
void tandem_verbs_double_vanish(void);

/* Counters of this process: "writes" (RDMA WRITEs with data transmitted), "sends", "reads", "recv_completions",
 * "rnr_waits" (an incoming SEND or WRITE_WITH_IMM found no posted receive and waited for one), "qps" (live QPs),
 * "mrs" (live MRs). Unknown names give UINT64_MAX. */
uint64_t tandem_verbs_double_counter(const char* name);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_VERBS_DOUBLE_CONTROL_H */
