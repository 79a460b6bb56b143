// ring_bench: submit-to-completion round trip through a real tandemd (CPU backend, barrier ops on a
// one-rank communicator per client), with 1..N client processes, while the daemon polls and while it sleeps.
//
//   ring_bench [--socket PATH | --tandemd PATH] [--clients 1,4] [--ops 20000]
//
// "polling": ops back to back, so the pump and the client stay inside their busy-poll windows.
// "sleeping": a pause longer than the poll windows before each op, so both sides sleep on their eventfds
// and every op pays the wake-up path.
// "pipelined": 32 ops in flight per client; reports throughput.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "private_daemon.hpp"
#include "tandem/tandem.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double p50us, p99us, opsPerSec;
};

// One client process: returns its latencies (µs) through a pipe, then exits.
void client(const std::string& socket, const std::string& mode, int ops, int fd) {
  tandem::Session s(socket.c_str());
  tandem::Communicator comm(s, tandem::uniqueId(), 1, 0);
  std::vector<float> lat;
  lat.reserve(static_cast<size_t>(ops));
  const auto start = Clock::now();
  if (mode == "pipelined") {
    std::vector<tandem_op_t> inflight;
    for (int i = 0; i < ops; ++i) {
      tandem_op_t op;
      tandem::check(tandem_barrier(comm.get(), &op));
      inflight.push_back(op);
      if (inflight.size() == 32) {
        for (auto& o : inflight) tandem::wait(o, 10000);
        inflight.clear();
      }
    }
    for (auto& o : inflight) tandem::wait(o, 10000);
  } else {
    for (int i = 0; i < ops; ++i) {
      if (mode == "sleeping") std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const auto t0 = Clock::now();
      tandem_op_t op;
      tandem::check(tandem_barrier(comm.get(), &op));
      tandem::wait(op, 10000);
      lat.push_back(std::chrono::duration<float, std::micro>(Clock::now() - t0).count());
    }
  }
  const float seconds = std::chrono::duration<float>(Clock::now() - start).count();
  lat.push_back(seconds);  // last value: wall time
  [[maybe_unused]] ssize_t n = ::write(fd, lat.data(), lat.size() * sizeof(float));
}

Stats measure(const std::string& socket, const std::string& mode, int clients, int ops) {
  std::vector<std::pair<pid_t, int>> kids;
  for (int c = 0; c < clients; ++c) {
    int p[2];
    if (::pipe(p) != 0) throw std::runtime_error("pipe");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      try {
        client(socket, mode, ops, p[1]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "client: %s\n", e.what());
        std::_Exit(1);
      }
      std::_Exit(0);
    }
    ::close(p[1]);
    kids.emplace_back(pid, p[0]);
  }
  std::vector<float> all;
  double totalOps = 0, maxSeconds = 0;
  for (auto& [pid, fd] : kids) {
    std::vector<float> got;
    float buf[4096];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0) got.insert(got.end(), buf, buf + n / sizeof(float));
    ::close(fd);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (got.empty() || !WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("a client failed");
    maxSeconds = std::max<double>(maxSeconds, got.back());
    got.pop_back();
    totalOps += ops;
    all.insert(all.end(), got.begin(), got.end());
  }
  std::sort(all.begin(), all.end());
  Stats st{};
  if (!all.empty()) {
    st.p50us = all[all.size() / 2];
    st.p99us = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  }
  st.opsPerSec = totalOps / maxSeconds;
  return st;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ring_bench: submit-to-completion round trip and throughput through tandemd's rings"};
  std::string socket, tandemd = TANDEMD_PATH;
  std::vector<int> clientCounts = {1, 4};
  int ops = 20000;
  app.add_option("--socket", socket, "use a running tandemd at this socket (default: start one)");
  app.add_option("--tandemd", tandemd, "tandemd binary to start when --socket is not given");
  app.add_option("--clients", clientCounts, "client process counts")->delimiter(',');
  app.add_option("--ops", ops, "ops per client (sleeping mode runs ops/20)");
  CLI11_PARSE(app, argc, argv);

  // The CPU backend: this measures the control plane and the rings, whatever hardware the host has.
  std::unique_ptr<tandem::bench::PrivateDaemon> daemon;
  if (socket.empty()) {
    daemon = std::make_unique<tandem::bench::PrivateDaemon>(tandemd, "daemon:\n  backend: cpu\n  log_level: warn\n");
    socket = daemon->socket();
  }
  std::printf("%-10s %-8s %-8s %-10s %-10s %-12s\n", "mode", "clients", "ops", "p50_us", "p99_us", "ops/s");
  int rc = 0;
  try {
    for (const char* mode : {"polling", "sleeping", "pipelined"}) {
      for (int clients : clientCounts) {
        const int n = std::string(mode) == "sleeping" ? std::max(50, ops / 20) : ops;
        const Stats st = measure(socket, mode, clients, n);
        std::printf("%-10s %-8d %-8d %-10.1f %-10.1f %-12.0f\n", mode, clients, n, st.p50us, st.p99us, st.opsPerSec);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring_bench: %s\n", e.what());
    rc = 1;
  }
  return rc;
}
