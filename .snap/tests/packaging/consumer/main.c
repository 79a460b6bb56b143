/* Links against an installed libtandem and checks that the header and the library agree on the version. Connecting
 * needs no daemon to fail cleanly: a missing socket is a status with a message, not a crash. */
#include <stdio.h>
#include <string.h>
#include <tandem/tandem.h>

int main(void) {
  int major = 0, minor = 0, patch = 0;
  tandem_get_version(&major, &minor, &patch);
  if (major != TANDEM_VERSION_MAJOR || minor != TANDEM_VERSION_MINOR) {
    printf("header %d.%d, library %d.%d\n", TANDEM_VERSION_MAJOR, TANDEM_VERSION_MINOR, major, minor);
    return 1;
  }
  tandem_session_t s;
  const tandem_status_t st = tandem_connect("/nonexistent/tandem-consumer.sock", &s);
  if (st == TANDEM_SUCCESS || strlen(tandem_last_error()) == 0) return 1;
  printf("consumer_c: libtandem %s, connect without a daemon: %s\n", tandem_version(), tandem_strerror(st));
  return 0;
}
