// The header-only C++ layer over an installed libtandem.
#include <cstdio>
#include <tandem/tandem.hpp>

int main() {
  try {
    tandem::Session s("/nonexistent/tandem-consumer.sock");
    return 1;
  } catch (const tandem::Exception& e) {
    std::printf("consumer_cxx: %s\n", e.what());
  }
  return 0;
}
