// `tandemctl status`: what tandemd reports about itself, its sessions, communicators, GPUs and cluster.
#include <fmt/format.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "advise.hpp"
#include "ctl.hpp"
#include "session.hpp"

namespace tandem::ctl {

using json = nlohmann::json;

int status(const std::string& socket, bool asJson) {
  auto session = client::Session::connect(socket);
  v1::Request request;
  request.mutable_query_status();
  const auto r = session->call(request).status_reply();
  if (asJson) {
    json j{{"daemon_version", r.daemon_version()}, {"backend", r.backend()}, {"executor", r.executor()},
           {"uptime_ms", r.uptime_ms()}, {"socket", r.socket_path()}, {"total_bytes", r.total_bytes()},
           {"total_buffers", r.total_buffers()}, {"sessions", json::array()}, {"communicators", json::array()}};
    for (const auto& s : r.sessions()) {
      j["sessions"].push_back({{"id", s.session_id()}, {"pid", s.pid()}, {"uid", s.uid()}, {"buffers", s.buffers()},
                               {"bytes", s.bytes()}, {"communicators", s.communicators()},
                               {"ops_completed", s.ops_completed()}});
    }
    for (const auto& c : r.communicators()) {
      j["communicators"].push_back({{"handle", c.comm_handle()}, {"nranks", c.nranks()}, {"joined", c.joined()},
                                    {"state", c.state()}, {"ops_completed", c.ops_completed()},
                                    {"local_ranks", c.local_ranks()}, {"nodes", c.nodes()}, {"reason", c.reason()}});
    }
    if (r.has_cluster()) {
      const auto& cl = r.cluster();
      json nodes = json::array();
      for (const auto& n : cl.nodes()) {
        nodes.push_back({{"index", n.index()}, {"address", n.address()}, {"state", n.state()}, {"reason", n.reason()},
                         {"hostname", n.hostname()}, {"daemon_version", n.daemon_version()}});
      }
      j["cluster"] = {{"self", cl.self()}, {"transport", cl.transport()}, {"staging_bytes", cl.staging_bytes()},
                      {"nodes", nodes}};
    }
    j["gpus"] = json::array();
    for (const auto& g : r.gpus()) {
      json peers = json::array();
      for (const auto& p : g.peers()) peers.push_back({{"uuid", p.uuid()}, {"nvlinks", p.nvlinks()}, {"p2p", p.p2p()}});
      j["gpus"].push_back({{"uuid", g.uuid()}, {"name", g.name()}, {"sms", g.sms()}, {"memory_bytes", g.memory_bytes()},
                           {"pci_bus_id", g.pci_bus_id()}, {"compute_capability", g.compute_capability()},
                           {"mps", g.mps()}, {"peers", peers}});
    }
    j["plans"] = planStatusJson(r);
    std::cout << j.dump(2) << std::endl;
    return 0;
  }
  std::printf("tandemd %s  backend %s  executor %s  up %.1f s  socket %s\n", r.daemon_version().c_str(),
              r.backend().c_str(), r.executor().c_str(), static_cast<double>(r.uptime_ms()) / 1000.0,
              r.socket_path().c_str());
  if (r.gpus_size() > 0) std::printf("gpus: %d\n", r.gpus_size());
  for (const auto& g : r.gpus()) {
    std::printf("  %s  %s  %u SMs  %.1f GiB  cc %s  pci %s  MPS %s\n", g.uuid().c_str(), g.name().c_str(), g.sms(),
                static_cast<double>(g.memory_bytes()) / (1u << 30), g.compute_capability().c_str(),
                g.pci_bus_id().c_str(), g.mps() ? "yes" : "no");
    for (const auto& p : g.peers()) {
      std::printf("    peer %s  NVLink x%u  p2p %s\n", p.uuid().c_str(), p.nvlinks(), p.p2p() ? "on" : "off");
    }
  }
  std::printf("sessions: %d (this one included)  buffers: %u  bytes: %lu\n", r.sessions_size(), r.total_buffers(),
              static_cast<unsigned long>(r.total_bytes()));
  for (const auto& s : r.sessions()) {
    std::printf("  session %-4lu pid %-7u uid %-6u buffers %-4u bytes %-12lu comms %-3u ops %lu\n",
                static_cast<unsigned long>(s.session_id()), s.pid(), s.uid(), s.buffers(),
                static_cast<unsigned long>(s.bytes()), s.communicators(), static_cast<unsigned long>(s.ops_completed()));
  }
  if (r.has_cluster()) {
    const auto& cl = r.cluster();
    std::printf("cluster: this is node %u of %d (transport %s, staging %lu bytes per peer)\n", cl.self(),
                cl.nodes_size(), cl.transport().c_str(), static_cast<unsigned long>(cl.staging_bytes()));
    for (const auto& n : cl.nodes()) {
      std::printf("  node %-3u %-24s %-12s %s%s%s\n", n.index(), n.address().c_str(), n.state().c_str(),
                  n.hostname().c_str(), n.reason().empty() ? "" : "  ", n.reason().c_str());
    }
  }
  std::printf("communicators: %d\n", r.communicators_size());
  for (const auto& c : r.communicators()) {
    std::string nodes;
    for (uint32_t n : c.nodes()) nodes += fmt::format("{}{}", nodes.empty() ? "  nodes " : ",", n);
    std::printf("  comm %-4lu ranks %u/%u (%u here)  state %-10s ops %lu%s%s%s\n",
                static_cast<unsigned long>(c.comm_handle()), c.joined(), c.nranks(), c.local_ranks(),
                c.state().c_str(), static_cast<unsigned long>(c.ops_completed()), nodes.c_str(),
                c.reason().empty() ? "" : "  ", c.reason().c_str());
  }
  printPlanStatus(r);
  return 0;
}

}  // namespace tandem::ctl
